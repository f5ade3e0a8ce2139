"""This machine's workers: how they are started (the warm pool, or fresh interpreters),
watched, stopped and reaped; their output; the network interface they use; the snapshots
this machine holds."""
