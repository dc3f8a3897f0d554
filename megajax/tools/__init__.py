"""Tools that read a compiled program: the HLO parser, the collective audit and the dry run."""
