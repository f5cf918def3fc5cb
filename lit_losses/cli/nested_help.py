"""``--model.grpo.help``: the help of an option's own class (`GRPOPreset`, `ParallelConfig`, …), which
``--model.help TinyLM`` lists.

jsonargparse prints it only after the help of the class that has the option (``--model.help TinyLM
--model.grpo.help``); alone, ``--model.grpo.help`` would be read as a value of ``--model``. `with_class_help`
puts the class's help in front of it: the class the command line chooses (`chosen_class`), else the
default one.
"""

from __future__ import annotations

import re

from lit_losses.cli.class_defaults import chosen_class

_NESTED_HELP = re.compile(r"--(model|data)(?:\.init_args)?\.(\w+(?:\.\w+)*)\.help")


def with_class_help(args: list[str]) -> list[str]:
    """``args`` with ``--model.help <class>`` in front of a nested help ``--model[.init_args].<option>.help``
    that none precedes (likewise ``--data``), and the nested help written as jsonargparse takes it
    (``--model.<option>.help``).

    Example:
        >>> with_class_help(["fit", "--model=HFCausalLM", "--model.init_args.parallel.help"])
        ['fit', '--model=HFCausalLM', '--model.help', 'HFCausalLM', '--model.parallel.help']
        >>> with_class_help(["fit", "--model.help", "TinyLM", "--model.grpo.help"])  # already in front
        ['fit', '--model.help', 'TinyLM', '--model.grpo.help']
    """
    for i, arg in enumerate(args):
        nested = _NESTED_HELP.fullmatch(str(arg))
        if nested is None:
            continue
        root, option = nested.groups()
        preceded = any(str(a).partition("=")[0] == f"--{root}.help" for a in args[:i])
        class_help = [] if preceded else [f"--{root}.help", chosen_class(args[:i], root)]
        return [*args[:i], *class_help, f"--{root}.{option}.help", *args[i + 1 :]]
    return args
