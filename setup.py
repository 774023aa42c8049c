"""The one compiled module, declared here (pyproject.toml's ``ext-modules`` table is still experimental in
setuptools and says so on every install); everything else is in pyproject.toml.

``ogrefs.supervise._settle``: the settled supervisor's loop in C (docs/mount.md, "What it costs"). Optional: a
box without a compiler or Python's headers installs without it and runs the same loop in Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ogrefs.supervise._settle", ["src/ogrefs/supervise/_settle.c"], optional=True)])
