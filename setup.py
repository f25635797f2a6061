"""Package discovery for the two halves under one `kvpilot` namespace.

pyproject.toml maps `kvpilot.engine` onto engine/ and `kvpilot.operator` onto operator/; this file
finds every sub-package below them, so a new one ships without anyone listing it, and names the
data files that ship inside them. operator/ itself
has no __init__.py (see docs/install.md, "Images"), so it is named here, not found.
"""

from setuptools import find_packages, setup


def packages(root: str) -> list[str]:
    return [f"kvpilot.{root}", *(f"kvpilot.{root}.{sub}" for sub in find_packages(root))]


setup(
    packages=packages("engine") + packages("operator"),
    # Plain data the code reads at run time: the built-in CPU device profiles, and the C++ source
    # of the engine's CPU kernels, which an engine builds at start-up where no library is cached.
    package_data={
        "kvpilot.operator.planning": ["profiles/*.json"],
        "kvpilot.engine.cpu": ["csrc/*.cpp"],
    },
)
