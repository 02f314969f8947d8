"""The command line: Typer commands, shared options, exit codes and terminal output."""
