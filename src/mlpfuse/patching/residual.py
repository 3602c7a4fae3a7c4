"""Hand a decoder layer's residual add after its MLP to the fused block: `h = residual + mlp(h)` becomes one call
whose down projection adds `residual` in its epilogue (at decode, in the decode kernels' last pass; at prefill, as
cuBLAS's C operand), so the add is no kernel of its own and y is rounded once instead of twice.

The layer's forward is read from its source, as the norm hand-over reads it (mlpfuse.patching.norms). Two forms
match, at any nesting inside the forward:

    X = self.<mlp>(X)                       X = R + self.<mlp>(A)        (or self.<mlp>(A) + R; also `return ...`)
    X = R + X        (or X + R)

with X and R plain names and R not X. Each becomes `X = self._mlpfuse_mlp_residual(A, R)`: the block's call with
the residual (`GatedBlock.forward(x, residual)`), or `R + self.<mlp>(A)` where the child is no longer a fused block
or something hooks it (a forward hook then sees the MLP's own output, as before). Anything between the MLP and the
add — a dropout (Phi-3's resid_mlp_dropout), a post-norm (Gemma 2/3), a scale — leaves the layer as it is, and the
patch report says which statement kept it.

Before a layer is rewritten, its block's call with a residual is checked on numbers against the residual plus its
plain call (`verify_residual`: random rows, the block's dtype and device, so the decode kernels' epilogue is what
runs on a GPU); a block that fails keeps the layer's add, with why.

The rewritten forward is the layer's own function compiled again from its source file with those statements
changed, in its module's globals and under its own decorators; it is installed on a subclass of the layer's class
(so every other layer of that class, patched or not, is untouched), which `unpatch` swaps back. A forward that
closes over variables (`super()`, a closure cell) is left alone: its function cannot be rebuilt outside its class;
so is one whose source file no longer compiles to the loaded function (edited or upgraded on disk since import).
"""

from __future__ import annotations

import __future__
import ast
import functools
import inspect
import linecache
import textwrap
from typing import Optional

import torch
import torch.nn as nn

from mlpfuse import fp8
from mlpfuse.patching import blocks
from mlpfuse.patching.report import FusedResidual, Left
from mlpfuse.patching.verify import differs, one_line

HELPER = "_mlpfuse_mlp_residual"


def fuse_residuals(model: nn.Module, report) -> None:
    """For each gated block `report` swapped in `model`, hand it the residual add after it where the layer's forward
    shows exactly that add right after the block's call."""
    for swapped in report.swapped:
        parent_path, _, name = swapped.path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if not isinstance(parent._modules.get(name), blocks.GatedBlock) or parent is model:
            continue
        cls = type(parent)
        if getattr(cls, "_mlpfuse_residual_of", None) is not None:
            continue  # fused already (patched twice)
        found = rewritten(cls, name)
        if found is None:
            continue  # the layer's forward never calls the block on its own (nothing to say)
        if isinstance(found, str):
            report.residuals_kept.append(Left(parent_path, cls.__name__, found))
            continue
        reason = verify_residual(parent._modules[name])
        if reason is not None:
            report.residuals_kept.append(Left(parent_path, cls.__name__, reason))
            continue
        parent.__class__ = found
        by = {"fp8": "its down projection's epilogue at decode sizes (added to its output above them)",
              "fp8-train": "its forward, after the FP8 training step (no epilogue of its own)"}.get(
            parent._modules[name].fused_precision)
        report.residuals.append(FusedResidual(parent_path, swapped.path, *((by,) if by else ())))


def verify_residual(block: "blocks.GatedBlock") -> Optional[str]:
    """None when the block's call with a residual equals the residual plus its plain call on random rows of its
    input width, in its dtype and on its device (the path decode-sized calls take: the decode kernels' epilogue),
    within a few roundings of the dtype; else why not. Blocks on the meta device are taken at their word."""
    first = block._modules[block.fused_linears[0]]
    weight = first.weight
    if weight.device.type == "meta":
        return None
    # The block's input dtype: the weights', or for FP8 projections (modules.Fp8Linear) the dtype they came from.
    dtype = first.dtype if weight.dtype == fp8.DTYPE else weight.dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    width = weight.shape[1]
    x, res = (torch.randn(2, 3, width, generator=gen).to(weight.device, dtype) for _ in range(2))
    try:
        with torch.no_grad():
            got = block(x, residual=res)
            want = res + block(x)
    except Exception as exc:  # noqa: BLE001 - a block that cannot take the residual keeps the layer's add
        return f"the block's call with the residual failed: {one_line(exc)}"
    return differs(got, want, 4 * torch.finfo(dtype).eps, "the block's call with the residual",
                   "residual + its output")


def restore_residuals(model: nn.Module) -> list[str]:
    """Undo `fuse_residuals`: every rewritten layer gets its class back."""
    restored = []
    for path, module in model.named_modules():
        source = type(module).__dict__.get("_mlpfuse_residual_of")
        if source is not None:
            module.__class__ = source
            restored.append(path)
    return restored


@functools.lru_cache(maxsize=None)
def rewritten(layer_cls: type, block_name: str):
    """A subclass of `layer_cls` whose forward hands the residual add after `self.<block_name>` to the block; a
    string saying why not; None when the forward does not call the block where a residual could follow."""
    raw = inspect.unwrap(layer_cls.forward)
    try:
        source = textwrap.dedent(inspect.getsource(raw))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    func = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if func is None:
        return None
    rewriter = _Rewriter(block_name)
    rewriter.visit(func)
    if not rewriter.fused:
        if rewriter.calls == 0:
            return None
        return rewriter.why or "the layer's forward does not add a residual to the MLP's output"
    forward = rebuilt(raw, tree, func)
    return forward if isinstance(forward, str) else _subclass(layer_cls, block_name, forward)


def rebuilt(raw, tree: ast.Module, func: ast.FunctionDef):
    """The forward `raw` compiled again from its rewritten source `tree` (whose one function is `func`), in its
    module's globals and under its own decorators; a string saying why not."""
    if not _same_code(raw):
        return "its source file no longer compiles to the loaded forward (changed on disk since import?)"
    if raw.__code__.co_freevars:
        return f"its forward closes over {', '.join(raw.__code__.co_freevars)}: it cannot be rebuilt outside its class"
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, raw.__code__.co_firstlineno - 1)
    namespace: dict = {}
    try:
        # Annotations stay strings (never evaluated: the module may import their names for type checkers only).
        code = compile(tree, raw.__code__.co_filename, "exec", flags=__future__.annotations.compiler_flag,
                       dont_inherit=True)
        exec(code, raw.__globals__, namespace)
    except Exception as exc:  # noqa: BLE001 - a forward that cannot be rebuilt stays as it is, with why
        return f"its forward could not be rebuilt ({one_line(exc)})"
    return namespace[func.name]


def _same_code(raw) -> bool:
    """Whether the source file on disk compiles to the very function the class holds (its bytecode, names and
    constants), so that the rewrite changes nothing but the two statements. The whole file is compiled (the opcodes
    of a call depend on what the module imports), not run."""
    path = raw.__code__.co_filename
    try:
        module = compile("".join(linecache.getlines(path)), path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    want = raw.__code__
    found, todo = None, [module]
    while todo and found is None:
        for c in todo.pop().co_consts:
            if isinstance(c, type(module)):
                if c.co_name == want.co_name and c.co_firstlineno == want.co_firstlineno:
                    found = c
                    break
                todo.append(c)
    return found is not None and all(getattr(found, a) == getattr(want, a) for a in (
        "co_code", "co_names", "co_varnames", "co_argcount", "co_consts", "co_flags"))


def _subclass(layer_cls: type, block_name: str, forward) -> type:
    def mlp_residual(self, x, residual):
        block = self._modules[block_name]
        if isinstance(block, blocks.GatedBlock) and not blocks._hooked(block):
            return block(x, residual=residual)
        return residual + block(x)

    return rewritten_class(layer_cls, forward, {HELPER: mlp_residual}, f"residual add in {block_name}'s epilogue",
                           _rebuild, (layer_cls, block_name),
                           {"_mlpfuse_residual_of": layer_cls, "_mlpfuse_residual_block": block_name})


def rewritten_class(cls: type, forward, methods: dict, note: str, rebuild, rebuild_args: tuple, attrs: dict) -> type:
    """A subclass of `cls` (same name and module) with the rebuilt `forward`, `methods` and `attrs`, its repr
    noting `note`, pickled (torch.save, deepcopy) as `rebuild(*rebuild_args, state)`: the original class plus the
    swap, since this class exists only in memory."""

    def __reduce_ex__(self, protocol):
        return rebuild, (*rebuild_args, self.__getstate__())

    def extra_repr(self) -> str:
        return ", ".join(part for part in (cls.extra_repr(self), f"{note} (mlpfuse)") if part)

    forward.__qualname__ = f"{cls.__qualname__}.forward"
    return type(cls.__name__, (cls,), {"forward": forward, **methods, "__reduce_ex__": __reduce_ex__,
                                       "extra_repr": extra_repr, **attrs, "__module__": cls.__module__})


def _rebuild(cls: type, block_name: str, state: dict) -> nn.Module:
    module = cls.__new__(cls)
    module.__setstate__(state)
    swapped = rewritten(cls, block_name)
    if isinstance(swapped, type):
        module.__class__ = swapped
    return module


class _Rewriter(ast.NodeTransformer):
    """Rewrites, in every statement list of the forward, the two matching forms into the helper's call; counts the
    block's calls and remembers why the first unmatched one was not taken."""

    def __init__(self, block: str):
        self.block = block
        self.fused = 0
        self.calls = 0
        self.why: Optional[str] = None

    def generic_visit(self, node):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                setattr(node, field, self._statements(stmts))
        for field, value in ast.iter_fields(node):
            if field in ("body", "orelse", "finalbody"):
                continue
            if isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        self.visit(item)
            elif isinstance(value, ast.AST):
                self.visit(value)
        return node

    def _statements(self, stmts: list) -> list:
        out = []
        i = 0
        while i < len(stmts):
            stmt = stmts[i]
            self.visit(stmt)  # nested blocks first
            one = self._one_statement(stmt)
            if one is not None:
                out.append(one)
                i += 1
                continue
            call = self._block_call(stmt)
            if call is not None:
                self.calls += 1
                target, arg = call
                nxt = stmts[i + 1] if i + 1 < len(stmts) else None
                res = self._add_of(nxt, target) if nxt is not None else None
                if res is not None:
                    out.append(self._helper_stmt(stmt, target, ast.Name(arg, ast.Load()), res))
                    self.fused += 1
                    i += 2
                    continue
                if self.why is None:
                    after = ast.unparse(nxt).splitlines()[0][:90] if nxt is not None else "nothing"
                    self.why = f"`{after}` follows the MLP's call, not `{target} = <residual> + {target}`"
            elif self._calls_block(stmt):
                self.calls += 1
                if self.why is None:
                    self.why = f"`{ast.unparse(stmt).splitlines()[0][:90]}` is not a residual add of the MLP's output"
            out.append(stmt)
            i += 1
        return out

    def _is_block(self, node) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                and node.func.attr == self.block and len(node.args) == 1 and not node.keywords
                and not isinstance(node.args[0], ast.Starred))

    def _calls_block(self, stmt) -> bool:
        return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == self.block
                   and isinstance(n.func.value, ast.Name) and n.func.value.id == "self" for n in ast.walk(stmt))

    def _block_call(self, stmt):
        """(X, X) for `X = self.<block>(X)`."""
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and self._is_block(stmt.value) and isinstance(stmt.value.args[0], ast.Name)
                and stmt.value.args[0].id == stmt.targets[0].id):
            return stmt.targets[0].id, stmt.value.args[0].id
        return None

    @staticmethod
    def _add_of(stmt, target: str) -> Optional[str]:
        """R for `target = R + target` or `target = target + R` (R a name other than target)."""
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id == target and isinstance(stmt.value, ast.BinOp)
                and isinstance(stmt.value.op, ast.Add)):
            return None
        left, right = stmt.value.left, stmt.value.right
        if not (isinstance(left, ast.Name) and isinstance(right, ast.Name)):
            return None
        if right.id == target and left.id != target:
            return left.id
        if left.id == target and right.id != target:
            return right.id
        return None

    def _one_statement(self, stmt):
        """`X = R + self.<block>(A)` / `X = self.<block>(A) + R` / `return ...` of the same, rewritten; else None."""
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value = stmt.value
        elif isinstance(stmt, ast.Return) and stmt.value is not None:
            value = stmt.value
        else:
            return None
        if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)):
            return None
        for res, call in ((value.left, value.right), (value.right, value.left)):
            if isinstance(res, ast.Name) and self._is_block(call):
                self.calls += 1
                self.fused += 1
                helper = self._helper_call(call.args[0], res.id)
                if isinstance(stmt, ast.Return):
                    return ast.copy_location(ast.Return(helper), stmt)
                return ast.copy_location(ast.Assign([ast.Name(stmt.targets[0].id, ast.Store())], helper), stmt)
        return None

    @staticmethod
    def _helper_call(arg, residual: str):
        return ast.Call(ast.Attribute(ast.Name("self", ast.Load()), HELPER, ast.Load()),
                        [arg, ast.Name(residual, ast.Load())], [])

    def _helper_stmt(self, stmt, target: str, arg, residual: str):
        return ast.copy_location(ast.Assign([ast.Name(target, ast.Store())], self._helper_call(arg, residual)), stmt)
