"""What a machine can do: its datasheet (`catalogue`: GPUSpec and the built-in GPUs), what `pentatron bench`
measured on it (`profile`: the profile file's schema; `kernel_tables`, `fp8_rowwise`: measured and published
kernel grids) and the one interface that reads both (`speeds`). The planner, the trainer's MFU, the run
report and `pentatron bench` import it; it imports none of them."""
