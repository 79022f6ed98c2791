"""Maps the source folders onto the installed package names.

``app/`` installs as ``tierwatch.server`` and ``agent/`` as ``tierwatch.agent``, so nothing as
generic as ``app`` or ``agent`` lands in a user's site-packages. The dashboard's ``templates/``
and ``static/`` folders and Alembic's ``migrations/`` ship inside ``tierwatch.server``.
Everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

SOURCE_ROOTS = {"app": "tierwatch.server", "agent": "tierwatch.agent"}
DATA_ROOTS = {
    "templates": "tierwatch.server.templates",
    "static": "tierwatch.server.static",
    "migrations": "tierwatch.server.migrations",
}

packages = ["tierwatch"]
package_dir = {"tierwatch": "tierwatch"}
for folder, name in {**SOURCE_ROOTS, **DATA_ROOTS}.items():
    package_dir[name] = folder
    packages.append(name)
for folder, name in SOURCE_ROOTS.items():
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]
packages += ["tierwatch.server.migrations.versions"]

setup(packages=packages, package_dir=package_dir)
