"""Refuse to import beside another distribution that installs a package under one of our names.

honest-rollouts installs the top-level packages ``verifiers``, ``rollout``, ``scripts`` and
``trainers``. Other distributions install packages under the first three: ``verifiers`` (a widely
used library of RL environments), ``rollout`` and ``scripts``. In one environment two packages of
one name overwrite each other's files or shadow one another on ``sys.path``, and the failure shows
far from its cause (a missing ``verifiers.chain``, another library's function). So importing our
``verifiers`` (and ``rollout``) first looks each of those names up as an installed distribution and
refuses, naming it and what to do, when one that is not ours installs a package of that name.

``importlib.metadata.distribution(name)``: one lookup per name (about 1-5 ms for the three, where
``packages_distributions()`` reads every installed distribution's file list, about 0.4 s here).
A distribution of another name that installs a ``verifiers`` package is not seen.

``rollout/__init__.py`` runs this file by its path (``runpy.run_path``): where ``import verifiers``
finds the other package our ``verifiers/__init__.py`` never runs, and importing the package there
would load torch (or that other library). So this module needs the standard library alone.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re

OURS = "honest-rollouts"
#: our import names that other distributions also use (``trainers`` has no namesake)
NAMES = ("verifiers", "rollout", "scripts")


class NameClashError(ImportError):
    """Another distribution installs a package under one of honest-rollouts' import names."""


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installs(dist: metadata.Distribution, package: str) -> bool:
    """Whether ``dist`` installs a top-level ``package`` (its ``top_level.txt``, else its file
    list; a distribution that records neither is taken at its name)."""
    top = dist.read_text("top_level.txt")
    if top is not None:
        return package in top.split()
    files = dist.files
    if files is None:
        return True
    return any(f.parts and f.parts[0] in (package, f"{package}.py") for f in files)


def clashing_distribution(package: str) -> metadata.Distribution | None:
    """The installed distribution named ``package`` that installs a top-level ``package`` and is
    not honest-rollouts, or None."""
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return None
    if _normalised(dist.metadata.get("Name") or package) == _normalised(OURS) or not _installs(dist, package):
        return None
    return dist


def clash_message(package: str, dist: metadata.Distribution) -> str:
    name = dist.metadata.get("Name") or package
    return (f"the '{name}' distribution {dist.version} is installed in this environment "
            f"({dist.locate_file('')}) and its package shares the import name '{package}' with honest-rollouts; "
            f"install honest-rollouts in its own virtual environment (python -m venv .venv && "
            f".venv/bin/pip install -e .) or uninstall '{name}' (pip uninstall {name})")


def check_import_names(names: tuple[str, ...] = NAMES) -> None:
    """Raise :class:`NameClashError` if another distribution installs a package under one of ``names``."""
    for package in names:
        dist = clashing_distribution(package)
        if dist is not None:
            raise NameClashError(clash_message(package, dist))
