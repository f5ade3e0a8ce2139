"""Why a group hangs or fails: every rank's stacks on request, the stall watchdog, and the
root cause of a failure that is only a timeout or a lost peer."""
