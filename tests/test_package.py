"""The package's shape, checked from its sources: imports run one way between layers, every kernel is declared
with the one decorator, and the Numba-writing rules of docs/design.md hold. Each failure names the file and line."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import fastattn

PACKAGE = Path(fastattn.__file__).resolve().parent
SOURCES = sorted(p for p in PACKAGE.rglob("*.py"))

#: Each top-level part of the package and its layer: a module imports only from lower layers or its own part.
LAYERS = {"_core": 0, "quant": 1, "norm": 2, "rows": 2, "rope": 2, "attention": 2, "reference": 3,
          "testing": 4, "integrations": 5, "jobs": 5, "__main__": 6, "__init__": 6}
#: The longest function a reader is asked to hold.
MAX_FUNCTION_LINES = 100
#: The most parameters a function takes; more are grouped (named tuples).
MAX_PARAMETERS = 12
#: Functions whose signatures mirror ggml's or FlashAttention's (excepted from MAX_PARAMETERS): the public ones on
#: both sides, and the argument parsers that take their arguments as they come.
MIRRORED_SIGNATURES = {"rope_ext", "rope_set_rows", "rope_cache", "flash_attn_func", "flash_attn_varlen_func",
                       "flash_attn_with_kvcache", "parse_varlen", "parse_kvcache"}
#: The decorators that compile a kernel; only ``_core/kernel.py`` may call Numba's own.
NUMBA_DECORATORS = {"njit", "jit", "generated_jit", "vectorize", "guvectorize", "cfunc"}


def _part(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _module_name(path: Path) -> str:
    parts = ["fastattn", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(line, absolute module) of every fastattn import in ``path``, functions' bodies included."""
    tree = ast.parse(path.read_text())
    here = _module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                yield node.lineno, module if module != "fastattn" else f"fastattn.{alias.name}"


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{line}"


def test_imports_run_one_way():
    wrong = []
    for path in SOURCES:
        part = _part(path)
        for line, module in _imports(path):
            if not module.startswith("fastattn."):
                continue
            target = module.split(".")[1]
            if target not in LAYERS:
                continue
            same_part = target == part
            if not same_part and LAYERS[target] >= LAYERS[part]:
                wrong.append(f"{_where(path, line)}: {part} (layer {LAYERS[part]}) imports {module} "
                             f"(layer {LAYERS[target]})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_module_imports_another_modules_private_names():
    """A name another module needs is public in its own module (no leading underscore)."""
    wrong = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fastattn")):
                wrong += [f"{_where(path, node.lineno)}: imports {alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not wrong, "\n".join(wrong)


def test_no_function_is_longer_than_a_reader_can_hold():
    """At most MAX_FUNCTION_LINES lines per function (its docstring included), kernels and the rest alike."""
    wrong = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    wrong.append(f"{_where(path, node.lineno)}: {node.name} has {length} lines")
    assert not wrong, "\n".join(wrong)


def test_no_function_takes_more_parameters_than_a_reader_can_hold():
    """At most MAX_PARAMETERS parameters per function, but those mirroring ggml's or FlashAttention's signatures."""
    wrong = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                if count > MAX_PARAMETERS and node.name not in MIRRORED_SIGNATURES:
                    wrong.append(f"{_where(path, node.lineno)}: {node.name} takes {count} parameters")
    assert not wrong, "\n".join(wrong)


def _kernel_functions(tree):
    """Functions decorated with ``kernel`` (bare or called)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                call = dec.func if isinstance(dec, ast.Call) else dec
                if isinstance(call, ast.Name) and call.id == "kernel":
                    yield node


def test_every_kernel_uses_the_one_decorator_and_no_blanket_fastmath():
    wrong = []
    for path in SOURCES:
        if path.relative_to(PACKAGE).as_posix() == "_core/kernel.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in NUMBA_DECORATORS and getattr(
                    node.value, "id", "") == "numba":
                wrong.append(f"{_where(path, node.lineno)}: numba.{node.attr}: declare kernels with "
                             "fastattn._core.kernel.kernel")
            if isinstance(node, ast.ImportFrom) and node.module == "numba":
                for alias in node.names:
                    if alias.name in NUMBA_DECORATORS:
                        wrong.append(f"{_where(path, node.lineno)}: imports numba.{alias.name}")
            if isinstance(node, ast.keyword) and node.arg == "fastmath" and isinstance(node.value, ast.Constant) \
                    and node.value.value is True:
                wrong.append(f"{_where(path, node.value.lineno)}: fastmath=True (nnan/ninf delete -inf guards)")
    assert not wrong, "\n".join(wrong)


def test_kernels_follow_the_numba_writing_rules():
    """Inside a kernel: no nested functions (closures), no ``astype`` (widen in registers: ``to_f32``), no
    array-to-array slice assignment (an explicit loop; filling a slice with a scalar is fine)."""
    wrong = []
    for path in SOURCES:
        for fn in _kernel_functions(ast.parse(path.read_text())):
            for node in ast.walk(fn):
                if node is not fn and isinstance(node, (ast.FunctionDef, ast.Lambda)):
                    wrong.append(f"{_where(path, node.lineno)}: a closure inside kernel {fn.name}")
                if isinstance(node, ast.Attribute) and node.attr == "astype":
                    wrong.append(f"{_where(path, node.lineno)}: astype inside kernel {fn.name}")
                if isinstance(node, (ast.Assign, ast.AugAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        if isinstance(target, ast.Subscript) and any(
                                isinstance(s, ast.Slice) for s in ast.walk(target.slice)) and any(
                                isinstance(s, ast.Slice) for s in ast.walk(node.value)):
                            wrong.append(f"{_where(path, node.lineno)}: slice assignment inside kernel {fn.name}")
    assert not wrong, "\n".join(wrong)


def test_the_reference_and_the_argument_rules_never_load_numba():
    code = ("import sys, fastattn, fastattn.reference\n"
            "import fastattn.attention.args, fastattn.rope.args, fastattn.norm.args, fastattn.rows.args\n"
            "assert 'numba' not in sys.modules, sorted(m for m in sys.modules if m.startswith('numba'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("part", ["attention", "rope", "norm", "rows", "quant"])
def test_each_op_package_starts_at_its_api_module(part):
    """``fastattn.<op>`` resolves to ``fastattn.<part>.api``: the public function a reader starts from."""
    ops = {name: module for name, module in fastattn._FAST_OPS.items() if module == f".{part}.api"}
    assert ops
    for name in ops:
        assert getattr(fastattn, name).__module__ in (f"fastattn.{part}.api", "fastattn._core.tensors")
        assert (PACKAGE / part / "api.py").read_text().count(f"\ndef {name}(") == 1


def _unit_calls(driver):
    """The argument tuples of ``driver``'s ``call_unit(unit, (...))`` calls, as source text per element."""
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(driver.py_func)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "call_unit":
            yield [ast.unparse(e) for e in node.args[1].elts]


def test_every_driver_calls_its_unit_with_the_units_parameters():
    """A work unit's signature declares its arguments (``_core.kernel.work_unit``); each driver passes its own
    arguments of those names, in that order, then the unit's extra arguments."""
    import fastattn.attention.api  # noqa: F401  (declares the attention units)
    import fastattn.rope.api  # noqa: F401  (declares the RoPE units)
    from fastattn._core.kernel import WORK_UNITS

    import inspect
    assert len(WORK_UNITS) >= 7
    for (unit_kernel, _, extra), drivers in WORK_UNITS:
        params = list(inspect.signature(unit_kernel.py_func).parameters)
        shared = params[:len(params) - len(extra)]
        for driver in drivers:
            calls = list(_unit_calls(driver))
            assert calls, f"{driver.py_func.__qualname__} never calls its unit"
            for passed in calls:
                assert len(passed) == len(params) and passed[:len(shared)] == shared, (
                    f"{driver.py_func.__qualname__} passes {passed} to {unit_kernel.py_func.__qualname__}{params}")


def test_a_driver_without_a_units_parameter_fails_at_declaration():
    from types import SimpleNamespace

    from fastattn._core.kernel import WORK_UNITS, work_unit

    def unit(q, k, extra_arg, u):
        pass

    def driver(unit, q, k):
        pass

    before = len(WORK_UNITS)
    with pytest.raises(TypeError, match="extra_arg"):
        work_unit(SimpleNamespace(py_func=unit), SimpleNamespace(py_func=driver), extra=(None,))
    assert len(WORK_UNITS) == before
