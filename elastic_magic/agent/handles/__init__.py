"""What the kernel holds of a running job or session: the handle (commands in, status and
events out) whose agent runs on a thread of its own."""
