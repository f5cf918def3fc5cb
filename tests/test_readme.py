"""The README's Python examples run as written, and it stays short (the rest lives in docs/)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 1
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})


def test_readme_is_short_and_its_links_exist():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links and all((README.parent / link).exists() for link in links if "://" not in link), links


def test_the_readme_feature_table_names_the_functional_head_api():
    """The head's functional layer is public and listed where a newcomer looks first."""
    import lit_losses.heads as heads

    row = next(line for line in README.read_text().splitlines() if line.startswith("| fused output head"))
    for name in ("linear_logprobs", "linear_cross_entropy", "linear_pointwise_loss"):
        assert f"`{name}`" in row and callable(getattr(heads, name))
