"""compile.backend as run: eager, inductor, or neuron with the AWS Neuron SDK present
(torch-free)."""

from __future__ import annotations

from importlib import metadata

from mmcli.errors import ConfigError

# What the neuron backend imports, the distributions that provide it, and where they come from.
NEURON_MODULES = {
    "torch_neuronx": "torch-neuronx",
    "neuronxcc": "neuronx-cc",
    "nki": "nki",
    "nkilib": "nki-library",
}
NEURON_SOURCE = (
    "AWS's Neuron pip repository (https://pip.repos.neuron.amazonaws.com), on a Trainium2 instance"
)


def require_neuron() -> None:
    """The Neuron SDK packages, or one line naming what is missing and where it comes from."""
    missing = []
    for module, dist in NEURON_MODULES.items():
        try:
            mod = __import__(module)
        except ImportError:
            missing.append(dist)
            continue
        # PyPI holds ~1 KB placeholder wheels under these names
        if module == "nki" and not hasattr(mod, "jit"):
            missing.append(f"{dist} (the installed one is PyPI's empty placeholder)")
    if missing:
        raise ConfigError(
            f"compile.backend neuron needs the AWS Neuron SDK: missing {', '.join(missing)}; "
            f"install them from {NEURON_SOURCE}"
        )


def resolve_backend(name: str) -> str:
    """compile.backend as run: auto is eager (bench/compile_speed.py measured eager ahead on the
    CPU); neuron only with the SDK present."""
    if name == "neuron":
        require_neuron()
    return "eager" if name == "auto" else name


def backend_version(backend: str) -> str:
    if backend == "neuron":
        return ", ".join(f"{d} {metadata.version(d)}" for d in NEURON_MODULES.values())
    import torch

    return f"torch {torch.__version__}"
