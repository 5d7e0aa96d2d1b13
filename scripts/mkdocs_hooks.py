"""mkdocs hooks (mkdocs.yml `hooks:`): the package's docstrings are written for Sphinx
(``:class:`Trainer```, ``text::`` before a literal block); mkdocstrings renders them as
Markdown, where those roles would show as ":class:" before the code. Strip them."""

import re

_ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const):(?=<code)")
_LITERAL = re.compile(r"::(?=</p>)")


def on_page_content(html, page, config, files):  # noqa: ARG001 (mkdocs' hook signature)
    """Remove Sphinx cross-reference roles and rst's '::' literal markers from a page."""
    return _LITERAL.sub(":", _ROLE.sub("", html))
