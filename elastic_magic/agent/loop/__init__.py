"""The loops that decide (a one-shot job's, a session's, a joined session's) and the engine
they share, which owns this machine's worker groups: round, start, inbox, teardown, result."""
