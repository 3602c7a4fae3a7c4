"""`mlpfuse patch --dry-run MODEL_DIR`: what mlpfuse.patch would swap in a model, and why it would leave the rest,
from the folder's config.json alone (no weights read or allocated)."""

from __future__ import annotations

import json

from mlpfuse.commands._help import add_parser, examples
from mlpfuse.errors import InputError, printable

DESCRIPTION = """\
Build the model of MODEL_DIR/config.json on the meta device (no weights), verify each MLP block mlpfuse recognises
(by class name or by structure) on a small-width copy built on the CPU, and print what would be swapped, with the
layout and real sizes, and what would be left, with the reason. Patching itself happens in Python, on a loaded
model: report = mlpfuse.patch(model).
"""

EPILOG = examples(
    ("python3 -c \"import transformers as t;t.LlamaConfig().save_pretrained('llama')\"", "a config folder"),
    ("mlpfuse patch --dry-run llama", "what patch would swap in it (no weights needed)"),
    ("mlpfuse patch --dry-run llama --backend torch --json", "as JSON"),
) + """

A Hugging Face model folder serves as it is: only its config.json is read. The folder is untrusted input:
config.json at most 4 MiB, sizes and layer counts bounded, no auto_map; none of its code is run (docs/patching.md
says what it may hold).

exit status: 0 ok, 2 bad input (no config.json, an unknown model type, a config past those bounds or one
transformers cannot build).
"""


def register(subparsers) -> None:
    p = add_parser(subparsers, "patch", help="show which MLP blocks mlpfuse.patch would swap in a model folder, and "
                   "why it leaves the rest", description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a local model folder with a config.json")
    p.add_argument("--dry-run", action="store_true", help="report only (required: the CLI never changes a model)")
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"),
                   help="the backend the blocks would run (default auto; it decides whether a lone linear + "
                   "activation is worth a block)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.dry_run:
        raise InputError("patch: only --dry-run is available from the command line; patch a loaded model in "
                         "Python with mlpfuse.patch(model)")
    from mlpfuse.patching.dry_run import dry_run

    result = dry_run(args.model_dir, args.backend)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        for line in result.lines():
            print(printable(line))
    return 0
