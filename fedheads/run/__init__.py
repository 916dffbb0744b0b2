"""Running head training: options (--set/--config/--dump-config), loading a store into a federation
(the only fedheads module that reads zarr), train/compare, the run directory, checkpoints and resume,
the run environment, the opt-in allocator policy and tracking."""
