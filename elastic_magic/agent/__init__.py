"""The supervisor that lives in the kernel: rendezvous, workers, monitoring, restarts."""
