"""Joining the world: the process each rank runs under (launch, engine), bootstrap, the
process group, Ctrl-C held during imports."""
