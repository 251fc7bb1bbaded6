"""torch.distributed for sparkserve: the parallel groups (parallel_state) and the mirror that
runs the driver's forwards on the other ranks."""
