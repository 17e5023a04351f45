"""The failure lab: runnable reproductions of training failures on the debug model (see docs/failure_lab.md)."""
