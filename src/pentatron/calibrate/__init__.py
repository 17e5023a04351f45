"""`pentatron bench`: calibration of a machine into a measured profile the planner reads."""
