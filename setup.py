"""Packages, found: the repository's top-level folders install under one import name.

``engine/`` installs as ``pagedserve.engine``, ``server/`` as ``pagedserve.server``, and so
on; ``pagedserve/`` holds the top-level package (the public names). Every package below
those folders is found, not listed (a folder with Python files or package data in it). The
rest of the project's metadata is in ``pyproject.toml``.
"""

from setuptools import find_namespace_packages, setup

FOLDERS = ("engine", "blockmgr", "kernels", "server", "loadtest")
"""The folders that install under ``pagedserve.``."""

package_dir = {"pagedserve": "pagedserve", **{f"pagedserve.{f}": f for f in FOLDERS}}
packages = ["pagedserve"]
for folder in FOLDERS:
    packages.append(f"pagedserve.{folder}")
    packages += [f"pagedserve.{folder}.{sub}"
                 for sub in find_namespace_packages(folder, exclude=["*__pycache__*"])]

setup(packages=packages, package_dir=package_dir)
