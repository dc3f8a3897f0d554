"""The host process: its environment (glibc's malloc settings, standard streams), the signals
that stop a run, and the multi-process runtime (start-up, agreement, bounded shutdown)."""
