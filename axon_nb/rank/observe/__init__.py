"""Seeing into a rank: the stack-answering thread, collective timing, the rank's status, the
model probe behind predictions."""
