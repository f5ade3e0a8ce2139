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
    """Every job option: its flag (and the value it takes), its Python keyword and default,
    what it does, and whether a machine that joins sets it for itself."""

    def run(self) -> list[nodes.Node]:
        from elastic_magic.spec import OPTIONS

        found = nodes.definition_list(classes=["elastic-options"])
        for option in OPTIONS:
            term = nodes.term()
            if option.flag:
                flag = f"{option.flag} {option.metavar}" if option.metavar else option.flag
                term += nodes.strong("", "", _literal(flag))
                term += nodes.Text(" · keyword ")
            else:
                term += nodes.emphasis("Python only", "Python only")
                term += nodes.Text(": keyword ")
            term += _literal(option.name)
            if option.default is not None:
                term += nodes.Text(" · default ")
                term += _literal(repr(option.default))
            text = option.help[0].upper() + option.help[1:] + "."
            if option.per_machine:
                text += " A machine that joins sets its own."
            definition = nodes.definition()
            definition += nodes.paragraph(text, text)
            item = nodes.definition_list_item(ids=[nodes.make_id(f"option-{option.name}")])
            item += term
            item += definition
            found += item
        return [found]


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
