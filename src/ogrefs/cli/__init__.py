"""The command line (click): every expected error becomes one line and an exit code."""
