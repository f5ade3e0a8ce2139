"""Reference pages generated from the code, so they cannot drift from it:

- ``.. elastic-options::`` -- every ``%%elastic`` flag and Python option, from
  ``elastic_magic.spec.OPTIONS`` (the same table the magic's parser and help are built from);
- ``.. elastic-cli::`` -- the ``elastic-magic`` command's help, from its argparse parser."""

from __future__ import annotations

import argparse
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.application import Sphinx


def _literal(text: str) -> nodes.literal:
    return nodes.literal(text, text)


class ElasticOptions(Directive):
    """A table of every job option: flag, Python keyword, default, what it does, and
    whether a joining machine sets it for itself."""

    def run(self) -> list[nodes.Node]:
        from elastic_magic.spec import OPTIONS

        table = nodes.table(classes=["elastic-options"])
        group = nodes.tgroup(cols=4)
        table += group
        for width in (22, 18, 12, 48):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        head += self._row(nodes.Text("%%elastic flag"), nodes.Text("Python keyword"),
                          nodes.Text("Default"), nodes.Text("What it does"))
        body = nodes.tbody()
        group += body
        for option in OPTIONS:
            flag = _literal(option.flag) if option.flag else nodes.emphasis(
                "Python only", "Python only")
            if option.metavar and option.flag:
                flag = nodes.inline("", "", _literal(f"{option.flag} {option.metavar}"))
            default = "" if option.default is None else repr(option.default)
            what = option.help + (" A joining machine sets its own." if option.per_machine
                                  else "")
            body += self._row(flag, _literal(option.name), nodes.Text(default),
                              nodes.Text(what))
        return [table]

    @staticmethod
    def _row(*cells: nodes.Node) -> nodes.row:
        row = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph("", "", cell)
            row += entry
        return row


class ElasticCli(Directive):
    """The ``elastic-magic`` command's help and each subcommand's, as argparse prints it."""

    def run(self) -> list[nodes.Node]:
        from elastic_magic import cli

        parser = cli._parser()
        found: list[nodes.Node] = [self._block(parser.format_help())]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    title = f"elastic-magic {name}"
                    section = nodes.section(ids=[nodes.make_id(title)])
                    section += nodes.title(title, title)
                    section += self._block(sub.format_help())
                    found.append(section)
        return found

    @staticmethod
    def _block(text: str) -> nodes.literal_block:
        return nodes.literal_block(text, text, language="text")


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("elastic-options", ElasticOptions)
    app.add_directive("elastic-cli", ElasticCli)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
