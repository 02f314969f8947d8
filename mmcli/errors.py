"""Errors that end a run with a documented exit code (README: exit codes)."""

from __future__ import annotations


class MmcliError(Exception):
    """An error shown to the user as one line; `exit_code` is what the CLI exits with."""

    exit_code = 1


class ConfigError(MmcliError):
    """Usage or configuration error: exit 2."""

    exit_code = 2


class CheckpointError(MmcliError):
    """The model cannot be found or loaded: exit 3, before any work."""

    exit_code = 3


class UnsupportedModel(CheckpointError):
    """A checkpoint of a family mmcli does not run: exit 2 (a usage error: choose another
    model)."""

    exit_code = 2


class ItemError(MmcliError):
    """One item cannot be done; the run goes on with the others (exit 1 at the end)."""

    exit_code = 1


class ImageError(ItemError):
    """One input image cannot be used."""


class OutputLocked(MmcliError):
    """Another run holds the output's lock: exit 2 (a usage error: choose another output or
    wait)."""

    exit_code = 2


class OutputError(MmcliError):
    """The output cannot be written: exit 3."""

    exit_code = 3
