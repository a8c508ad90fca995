"""The documentation stays true: the map lists exactly the packages there are, the
configuration reference is what the code generates, the front pages keep their size, and
every relative link lands on a file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from hybridserve.cluster import config_reference
from hybridserve.workers import support_table
from hybridserve.workers.models.registry import ADAPTERS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FOLDERS = {"bench", "cluster", "kernels", "transceiver", "workers"}


def packages_on_disk() -> set[str]:
    found = set()
    for folder in FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT).parts
            found.add(".".join(("hybridserve", *relative)))
    return found


def test_the_map_lists_every_package_and_only_packages_that_exist():
    listed = set(
        re.findall(r"^\| `(hybridserve[\w.]*)` \|", (DOCS / "structure.md").read_text(), re.M)
    )
    assert listed == packages_on_disk()


def test_every_package_is_installed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert set(project["tool"]["setuptools"]["packages"]) == packages_on_disk()


def test_the_configuration_reference_is_the_generated_one():
    """Regenerate with `python -m hybridserve.cluster.config_reference > docs/configuration.md`."""
    assert (DOCS / "configuration.md").read_text() == config_reference.reference()


def test_the_readme_support_table_is_the_generated_one():
    """Regenerate with `python -m hybridserve.workers.support_table` (between its markers)."""
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index(support_table.BEGIN), readme.index(support_table.END)
    assert readme[start : end + len(support_table.END) + 1] == support_table.table()


def test_every_registered_model_type_is_in_exactly_one_family():
    listed = [t for family in support_table.families() for t in family.model_types]
    assert sorted(listed) == sorted(ADAPTERS)


@pytest.mark.parametrize(("page", "limit"), [("README.md", 300), ("docs/architecture.md", 400)])
def test_the_front_pages_stay_short(page, limit):
    assert len((ROOT / page).read_text().splitlines()) <= limit


PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_lands_on_a_file(page):
    text = page.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if "://" not in link and not (page.parent / link).exists()]
    assert not missing, f"{page.name}: {missing}"
