"""Installs the repository's top-level folders flows/, tasks/ and stages/ as unirl.flows,
unirl.tasks and unirl.stages (pyproject.toml holds everything else): a wheel holds no
top-level package but `unirl`."""
from setuptools import find_packages, setup

PARTS = ("flows", "tasks", "stages")

setup(
    package_dir={"unirl": "src/unirl", **{f"unirl.{part}": part for part in PARTS}},
    packages=["unirl", *(f"unirl.{name}" for name in find_packages(include=[f"{part}*" for part in PARTS]))],
)
