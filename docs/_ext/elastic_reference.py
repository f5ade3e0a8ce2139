"""Reference pages generated from the code, so they cannot drift from it:

- ``.. elastic-options::`` -- every ``%%elastic`` flag and Python option, from
  ``elastic_magic.spec.OPTIONS`` (the same table the magic's parser and help are built from);
- ``.. elastic-view-flags::`` -- the flags that say how a cell is shown, from the magic's own
  table;
- ``.. elastic-cli::`` -- the ``elastic-magic`` command's help, from its argparse parser."""

from __future__ import annotations

import argparse
import os
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
            if option.action in ("store_false", "store_true"):  # the flag sets the opposite
                term += nodes.Text(" · the flag sets ")
                term += _literal(f"{option.name}={option.action == 'store_true'}")
            elif option.default is not None:
                term += nodes.Text(" · default ")
                term += _literal(str(option.default))
            text = _sentence(option.help.replace("%%", "%"))  # argparse's escape
            if option.name in _SESSION_DEFAULTS:
                text += f" A Session's default: {_SESSION_DEFAULTS[option.name]}."
            if option.per_machine:
                text += " A machine that joins sets its own."
            found += _item(f"option-{option.name}", term, text)
        return [found]


class ElasticViewFlags(Directive):
    """The flags a cell takes besides the job's options: how it is shown and kept."""

    def run(self) -> list[nodes.Node]:
        from elastic_magic.notebook.magics import _VIEW_FLAGS

        found = nodes.definition_list(classes=["elastic-options"])
        for names, kwargs in _VIEW_FLAGS:
            term = nodes.term()
            flags = ", ".join(names)
            metavar = kwargs.get("metavar")
            term += nodes.strong("", "", _literal(f"{flags} {metavar}" if metavar else flags))
            found += _item(f"flag-{names[-1].lstrip('-')}", term,
                           _sentence(kwargs["help"].replace("%%", "%")))
        return [found]


def _session_defaults() -> dict[str, str]:
    from elastic_magic.notebook.session import SESSION_MAX_RESTARTS

    return {"max_restarts": str(SESSION_MAX_RESTARTS)}


_SESSION_DEFAULTS = _session_defaults()


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def _item(anchor: str, term: nodes.term, text: str) -> nodes.definition_list_item:
    definition = nodes.definition()
    definition += nodes.paragraph(text, text)
    item = nodes.definition_list_item(ids=[nodes.make_id(anchor)])
    item += term
    item += definition
    return item


class ElasticCli(Directive):
    """The ``elastic-magic`` command's help and each subcommand's, as argparse prints it."""

    def run(self) -> list[nodes.Node]:
        from elastic_magic import cli

        # argparse wraps to the terminal's width: the page's, not the build's
        width, os.environ["COLUMNS"] = os.environ.get("COLUMNS"), "88"
        try:
            return self._pages(cli._parser())
        finally:
            if width is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = width

    def _pages(self, parser: argparse.ArgumentParser) -> list[nodes.Node]:
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
    app.add_directive("elastic-view-flags", ElasticViewFlags)
    app.add_directive("elastic-cli", ElasticCli)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
