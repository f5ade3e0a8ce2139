"""Machines, links and the rendezvous: the role this machine plays (alone, the head, joined),
the signed links between machines, and torch's c10d rendezvous with its store signed."""
