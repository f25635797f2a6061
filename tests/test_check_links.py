"""tests/check_links.py (run by `make lint`) finds what it should on small pages, and README.md, docs/
and bench/ pass it."""

from __future__ import annotations

from pathlib import Path

from tests.check_links import ROOT, anchors, check, slug


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checkout_passes() -> None:
    assert check(ROOT) == []


def test_headings_slug_as_github_slugs_them(tmp_path: Path) -> None:
    assert slug("The compiled decode step (`--compile-decode`)") == "the-compiled-decode-step---compile-decode"
    assert slug("Plan accuracy on CPU (`python -m bench.plan_accuracy`)") == (
        "plan-accuracy-on-cpu-python--m-benchplan_accuracy"
    )
    assert slug("[spec.model](#x) *and* <b>more</b>") == "specmodel-and-more"
    page = write(tmp_path, {"a.md": '# Twice\n## Twice\n```sh\n# not a heading\n```\n<a id="here"></a>\n'})
    assert anchors(page / "a.md") == {"twice", "twice-1", "here"}


def test_broken_links_are_found_and_good_ones_pass(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "README.md": "[ok](docs/a.md#a-heading) [self](#top) [dir](docs/)\n"
            "[gone](docs/missing.md) [bad anchor](docs/a.md#nowhere) [out](../x.md) [web](https://example.com/p)\n"
            "[ref]: https:/example.com\n`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n# Top\n",
            "docs/a.md": "# A heading\n[up](../README.md#top) [mail](mailto:a@b.c) [ftp](ftp://x.org)\n",
            "docs/orphan.md": "# Nobody links here\n",
        },
    )
    assert check(root) == [
        "README.md:2: docs/missing.md: docs/missing.md does not exist",
        "README.md:2: docs/a.md#nowhere: no heading of docs/a.md has the anchor #nowhere",
        "README.md:2: ../x.md: leaves the repository",
        "README.md:3: https:/example.com: '' is not a host name",
        "docs/a.md:2: ftp://x.org: scheme 'ftp' is neither http(s) nor mailto",
        "docs/orphan.md: not linked from README.md",
    ]
