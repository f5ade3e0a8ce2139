"""What travels between the kernel, its workers and other machines: typed
messages, signed length-prefixed frames, the events renderers consume, and the cell's payload."""
