"""Who reads each config field: a static scan of megarlhf's code (outside megarlhf/config)
for attribute reads whose object is known to be that field's config section.

An object is known to be a section (a config dataclass) when it is
- an attribute named as the section is reached from its parent (``cfg.ppo``,
  ``spec.model``, ``role_cfg.parallel``), the parent's class deciding where it is known;
- a name bound, in the same function or an enclosing one or the module, to such an
  object (``ppo = cfg.ppo``; ``ppo, r = cfg.ppo, cfg.rollout``; ``for role in ...`` is
  not followed), or a parameter annotated with the section's class;
- ``getattr(roles, name)`` on a section whose fields all hold one class (the roles);
- ``a or b``, ``a if c else b`` of such objects.
A field is read by ``obj.field`` or ``getattr(obj, "field")``, through a property or method
of its class that reads ``self.field`` or ``self.section.field`` (``model.ffn_size``,
``parallel.layout``, ``ppo.kl_reward_on``), or by ``getattr(obj, key)`` with a
non-constant key in a module whose string constants name the field (a table of columns).
Calls such as ``dataclasses.asdict`` and the config package's own validation do not
count: a field only the loader touches does nothing.

Fields are tracked per class: ``roles.critic.parallel`` and ``roles.actor.parallel`` share
``RoleParallelConfig``'s readers.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dataclass_of(hint) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def config_tree(root: type) -> tuple[dict[str, type], dict[type, dict[str, type]]]:
    """({class name: class}, {class: {field that holds a section: its class}})."""
    classes, children = {}, {}
    todo = [root]
    while todo:
        cls = todo.pop()
        if cls.__name__ in classes:
            continue
        classes[cls.__name__] = cls
        hints = typing.get_type_hints(cls)
        children[cls] = {}
        for f in dataclasses.fields(cls):
            sub = _dataclass_of(hints[f.name])
            if sub is not None:
                children[cls][f.name] = sub
                todo.append(sub)
    return classes, children


def leaf_fields(root: type, prefix: str = "") -> list[tuple[str, type, str]]:
    """(dotted name, class, field) of every field that is not itself a section."""
    out = []
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            out += leaf_fields(sub, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, root, f.name))
    return out


def properties(schema_source: str, classes: dict[str, type]) -> dict[type, dict[str, set]]:
    """{class: {property or method: fields it reads through ``self``}} from the schema's
    source (validation, ``__post_init__``, is not a reader)."""
    out: dict = {}
    for node in ast.parse(schema_source).body:
        if not isinstance(node, ast.ClassDef) or node.name not in classes:
            continue
        cls = classes[node.name]
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and not item.name.startswith("__"):
                reads = {n.attr for n in ast.walk(item) if isinstance(n, ast.Attribute)
                         and isinstance(n.value, ast.Name) and n.value.id == "self"}
                reads |= {f"{n.value.attr}.{n.attr}" for n in ast.walk(item)
                          if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                          and isinstance(n.value.value, ast.Name)
                          and n.value.value.id == "self"}  # self.kl.in_reward
                out.setdefault(cls, {})[item.name] = reads
    return out


class _Scanner:
    def __init__(self, root: type, props: dict):
        self.classes, self.children = config_tree(root)
        self.root = root
        self.props = props
        self.fields = {cls: {f.name for f in dataclasses.fields(cls)}
                       for cls in self.children}
        # attribute name -> {parent class: child class}
        self.access: dict[str, dict[type, type]] = {}
        for parent, kids in self.children.items():
            for name, child in kids.items():
                self.access.setdefault(name, {})[parent] = child
        self.reads: set[tuple[type, str]] = set()

    # -- what an expression denotes
    def denote(self, node, scope) -> set:
        if isinstance(node, ast.Attribute) and node.attr in self.access:
            by_parent = self.access[node.attr]
            parents = self.denote(node.value, scope)
            known = {by_parent[p] for p in parents if p in by_parent}
            return known or set(by_parent.values())
        if isinstance(node, ast.Name):
            return scope.lookup(node.id)
        if isinstance(node, ast.BoolOp):
            return set().union(*(self.denote(v, scope) for v in node.values))
        if isinstance(node, ast.IfExp):
            return self.denote(node.body, scope) | self.denote(node.orelse, scope)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "getattr" and len(node.args) >= 2 and \
                not isinstance(node.args[1], ast.Constant):
            out = set()
            for parent in self.denote(node.args[0], scope):
                kinds = set(self.children.get(parent, {}).values())
                if len(kinds) == 1 and len(self.children[parent]) == len(self.fields[parent]):
                    out |= kinds
            return out
        return set()

    def annotation(self, ann) -> set:
        if ann is None:
            return set()
        words = set(re.findall(r"[A-Za-z_]\w*", ast.unparse(ann)))
        return {cls for name, cls in self.classes.items() if name in words}

    # -- reads
    def read(self, cls, name: str) -> None:
        if name in self.fields[cls]:
            self.reads.add((cls, name))
        for field in self.props.get(cls, {}).get(name, ()):
            section, _, inner = field.partition(".")
            if inner and section in self.children[cls]:
                self.reads.add((self.children[cls][section], inner))
            elif field in self.fields[cls]:
                self.reads.add((cls, field))

    def scan_module(self, tree: ast.Module) -> None:
        module = _Scope(None)
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str)}
        self._bind_all(tree, module)
        self._walk(tree, module, strings)

    def _bind_all(self, node, scope) -> None:
        """Bindings of this scope (not of nested functions), to a fixed point."""
        assigns = []
        for child in _own_nodes(node):
            if isinstance(child, ast.Assign):
                for target in child.targets:
                    assigns.append((target, child.value))
            elif isinstance(child, ast.AnnAssign) and child.value is not None:
                assigns.append((child.target, child.value))
                scope.add(getattr(child.target, "id", None), self.annotation(child.annotation))
        for _ in range(3):
            for target, value in assigns:
                self._bind(target, value, scope)

    def _bind(self, target, value, scope) -> None:
        if isinstance(target, ast.Name):
            scope.add(target.id, self.denote(value, scope))
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._bind(t, v, scope)

    def _walk(self, node, scope, strings) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = _Scope(scope)
                args = child.args
                for a in args.posonlyargs + args.args + args.kwonlyargs:
                    inner.add(a.arg, self.annotation(a.annotation))
                self._bind_all(child, inner)
                self._walk(child, inner, strings)
                continue
            if isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Load):
                for cls in self.denote(child.value, scope):
                    self.read(cls, child.attr)
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and \
                    child.func.id == "getattr" and len(child.args) >= 2:
                key = child.args[1]
                for cls in self.denote(child.args[0], scope):
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        self.read(cls, key.value)
                    else:
                        for name in strings & self.fields[cls]:
                            self.read(cls, name)
            self._walk(child, scope, strings)


class _Scope:
    def __init__(self, parent):
        self.parent, self.names = parent, {}

    def add(self, name, classes) -> None:
        if name and classes:
            self.names.setdefault(name, set()).update(classes)

    def lookup(self, name) -> set:
        scope = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return set()


def _own_nodes(node):
    """Nodes of ``node``'s own scope (not inside nested functions or classes)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                  ast.ClassDef)):
            yield from _own_nodes(child)


def readers(root: type, sources: dict[str, str], schema_source: str) -> set[tuple[type, str]]:
    """(class, field) pairs read somewhere in ``sources`` ({path: code})."""
    classes, _ = config_tree(root)
    scanner = _Scanner(root, properties(schema_source, classes))
    for text in sources.values():
        scanner.scan_module(ast.parse(text))
    return scanner.reads


def schema_source() -> str:
    """The section modules of megarlhf/config, one text (their properties and methods)."""
    folder = os.path.join(ROOT, "megarlhf", "config")
    return "\n".join(open(os.path.join(folder, name)).read()
                     for name in sorted(os.listdir(folder)) if name.endswith(".py"))


def package_sources() -> dict[str, str]:
    """megarlhf's modules outside megarlhf/config (the loader and validation)."""
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "megarlhf")):
        if os.path.relpath(folder, ROOT).replace(os.sep, "/").startswith("megarlhf/config"):
            continue
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                out[os.path.relpath(path, ROOT)] = open(path).read()
    return out
