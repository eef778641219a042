"""The planner: memory and time per strategy, the search, the hardware table and its calibration."""
