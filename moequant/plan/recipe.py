"""Recipes: the YAML file that says what to quantize, how, and for which serving engine.

A recipe is plain data validated by pydantic; every stage reads the fields it needs. Loading
goes through `load_recipe(path, overrides)`, which applies `--set dotted.key=value` overrides
(values parsed as YAML, so `keep=[router]` or `experts.budget={gigabytes: 2}` work) and turns
any validation problem into one `UserError` sentence naming the file, the key, the bad value
and what is accepted.

```yaml
model: zoo:tiny-qwen2moe      # zoo:NAME, an HF id, or a local directory
output: runs/NAME
target: vllm                  # a registered target (moequant.targets): vllm | vllm-cuda | sglang | transformers | vllm-moequant | llama.cpp
calibration: {dataset: builtin:mix, samples: 128, seq_len: 512, all_experts: true, probe_samples: 32}
keep: [router, shared_experts, attention, embeddings, lm_head]   # stay bf16
non_experts: {format: bf16}   # format for attention / shared experts / dense MLPs not kept
experts:
  method: budget              # budget | rules | uniform
  budget: {bits_per_weight: 4.5}        # or {gigabytes: 12.0}
  formats: [fp8, int8, int4, mxfp4]     # candidates (names, or exact keys like int4-g64-sym)
  format: int4                          # with method: uniform
  rules:                                # with method: rules; first match wins
    - {share_at_least: 2.0, format: fp8}   # routing share relative to the layer mean
    - {share_below: 0.25, format: int4}
    - {layers: "0-3", format: int8}
    - {format: int4}
  usage_floor: 0.05           # see moequant.plan.context: usage weight of never-routed experts
  prune: {experts: 2, saliency: reap}   # or {fraction: 0.25}: drop that many experts of every MoE layer (plan.prune);
                                        # or {by: budget}: the budget chooses how many (plan.drop)
algorithms: {int4: gptq, mxfp4: gptq, int8: rtn, fp8: rtn}
gptq:                         # how GPTQ rounds (moequant.algorithms.registry.GptqOptions)
  grid: searched              # | minmax
  refit: true
  gpu_math: {update_matmul: tf32, cholesky_matmul: tf32x3, cholesky: auto, triton: true, cuda_graphs: true}
formats: {int4: {group_size: 128, symmetric: true}, fp8: {block: [128, 128]}}
export: {format: compressed-tensors}    # | gptq | awq | fp8-block | gpt-oss-mxfp4
evaluate: {dataset: builtin:mix, samples: 64, seq_len: 512}
seed: 0
```
"""

from __future__ import annotations

import copy
import re
import reprlib
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import Annotated

from moequant.algorithms.registry import ALGORITHMS
from moequant.algorithms.registry import GptqOptions as Gptq
from moequant.errors import UserError
from moequant.formats import REGISTRY, format_names, get_format, parse_key
from moequant.layouts import RECIPE_LAYOUTS, layout_for
from moequant.measure.saliency import CRITERIA as SALIENCY_CRITERIA
from moequant.measure.settings import DEFAULT_DATASET, Calibration
from moequant.targets import TARGETS, get_target

FORMAT_NAMES = format_names()  # every registered format (moequant.formats), llama.cpp's block types last
GGML_TYPES = format_names(ggml=True)
METHODS = ("budget", "rules", "uniform")
EXPORT_FORMATS = tuple(RECIPE_LAYOUTS)  # the built-in export layouts (moequant.layouts) by their recipe names
# Names `keep` accepts besides tensor-name patterns (anything containing '*' or '.').
KEEP_GROUPS = (
    "router",
    "shared_expert_gate",
    "shared_experts",
    "attention",
    "dense_mlp",
    "embeddings",
    "lm_head",
    "routed_experts",
)
DEFAULT_MODEL = "zoo:tiny-qwen2moe"


def is_format_key(entry: str) -> bool:
    """True for an exact format key such as `int4-g64-sym`, False for a bare name such as `int4`."""
    return "-" in entry


def check_format_entry(value: str) -> str:
    """A format entry is a bare name (params from the recipe's `formats` map) or an exact key."""
    name = value.split("-", 1)[0]
    if name not in FORMAT_NAMES:
        raise ValueError(
            f"'{value}' is not a format; accepted: {', '.join(FORMAT_NAMES)} (or an exact key such as int4-g64-sym)"
        )
    return value


FormatEntry = Annotated[str, AfterValidator(check_format_entry)]


def registered(value, names) -> str:
    """`value` when it is one of `names` (a registry, read when the recipe is validated, so entries registered
    after import count too), else the error pydantic gives a Literal."""
    if isinstance(value, str) and value in names:
        return value
    shown = [repr(n) for n in names]
    expected = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
    raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})


def check_algorithm(value: str) -> str:
    """An algorithm name is one registered when the recipe is validated (moequant.algorithms.registry)."""
    return registered(value, ALGORITHMS)


AlgorithmName = Annotated[str, AfterValidator(check_algorithm)]


def check_target(value: str) -> str:
    """A target is one registered when the recipe is validated (moequant.targets), not only the built-in ones."""
    return registered(value, TARGETS)


TargetName = Annotated[str, AfterValidator(check_target)]


def parse_layer_ranges(text: str | int) -> frozenset[int]:
    """'0-3,7' -> {0,1,2,3,7}; an int is one layer."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"'{text}' is not a layer list; accepted: e.g. \"0-3,7\"")
        return frozenset([text])
    layers: set[int] = set()
    for part in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise ValueError(f"'{text}' is not a layer list; accepted: e.g. \"0-3,7\"")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        layers.update(range(first, last + 1))
    return frozenset(layers)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Evaluate(Strict):
    dataset: str = DEFAULT_DATASET
    samples: int = Field(64, gt=0)
    seq_len: int = Field(512, gt=0)


class Export(Strict):
    format: str = "compressed-tensors"  # a registered layout's recipe name, checked when the recipe is read
    # int8 weights export as W8A16 (vLLM GPU Marlin) by default; "dynamic" writes W8A8 with dynamic
    # per-token int8 activations, which vLLM's CPU build needs
    int8_activations: Literal["none", "dynamic"] = "none"
    # gguf: how tensors the plan leaves unquantized are stored (bf16 is exact for bf16 checkpoints)
    gguf_float: Literal["bf16", "f16", "f32"] = "bf16"
    # gguf: ggml types for the token embeddings and output.weight (null: gguf_float), as llama.cpp's
    # --token-embedding-type / --output-tensor-type; round-to-nearest with our scale search
    gguf_token_embd: Optional[Literal[GGML_TYPES]] = None
    gguf_output: Optional[Literal[GGML_TYPES]] = None

    @field_validator("format", mode="before")
    @classmethod
    def _registered_layout(cls, value):
        """Any layout registered when the recipe is read (moequant.layouts.registry), not only the built-in ones."""
        return registered(value, RECIPE_LAYOUTS)

    @property
    def gguf_types(self) -> dict[str, str | None]:
        """{GGUF tensor name: ggml type or None}: export_checkpoint's gguf_types."""
        return {"token_embd.weight": self.gguf_token_embd, "output.weight": self.gguf_output}


class Budget(Strict):
    """Exactly one of: bits per routed-expert weight, or gigabytes (10^9 bytes) for the whole model."""

    bits_per_weight: Optional[float] = Field(None, gt=0)
    gigabytes: Optional[float] = Field(None, gt=0)

    @model_validator(mode="after")
    def one_kind(self):
        if (self.bits_per_weight is None) == (self.gigabytes is None):
            raise ValueError(
                "give exactly one of bits_per_weight or gigabytes "
                "(override the whole budget, e.g. experts.budget={gigabytes: 2})"
            )
        return self


class Rule(Strict):
    """Conditions all hold (an empty rule matches everything); `format` is required."""

    share_at_least: Optional[float] = Field(None, ge=0)
    share_below: Optional[float] = Field(None, gt=0)
    layers: Optional[str | int] = None
    format: FormatEntry

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, value):
        if value is not None:
            parse_layer_ranges(value)
        return value

    def layer_set(self) -> frozenset[int] | None:
        return None if self.layers is None else parse_layer_ranges(self.layers)


class Prune(Strict):
    """Experts dropped from every MoE layer (moequant.plan.prune): a count or a fraction of each layer's, the
    lowest by `saliency` (moequant.measure.saliency) in each layer; or `by: budget`, the count chosen by the
    budget solver with drop as one more precision (moequant.plan.drop: the measured KL of dropping, saliency kl)."""

    experts: Optional[int] = Field(None, gt=0)
    fraction: Optional[float] = Field(None, gt=0, lt=1)
    by: Optional[Literal["budget"]] = None
    saliency: Literal[SALIENCY_CRITERIA] = "reap"

    @model_validator(mode="after")
    def one_kind(self):
        if sum(x is not None for x in (self.experts, self.fraction, self.by)) != 1:
            raise ValueError(
                "give exactly one of experts (a count per layer), fraction or by: budget, e.g. {experts: 2}"
            )
        if self.by == "budget" and "saliency" in self.model_fields_set and self.saliency != "kl":
            raise ValueError("by: budget weighs the measured KL of dropping each expert: saliency kl (or none)")
        return self


class Experts(Strict):
    method: Literal[METHODS] = "budget"
    budget: Optional[Budget] = None
    formats: list[FormatEntry] = Field(default_factory=lambda: ["int8", "int4"])
    format: Optional[FormatEntry] = None
    rules: Optional[list[Rule]] = None
    usage_floor: float = Field(0.05, ge=0, le=1)
    prune: Optional[Prune] = None

    @field_validator("formats")
    @classmethod
    def _check_formats(cls, value):
        if not value:
            raise ValueError("the candidate list is empty; accepted: a list of formats such as [fp8, int8, int4]")
        if len(set(value)) != len(value):
            raise ValueError(f"{value} names a format twice")
        return value

    @model_validator(mode="after")
    def method_needs(self):
        if self.method == "budget" and self.budget is None:
            raise ValueError("method budget needs experts.budget, e.g. {bits_per_weight: 4.5} or {gigabytes: 12}")
        if self.method == "uniform" and self.format is None:
            raise ValueError("method uniform needs experts.format, e.g. int4")
        if self.method == "rules" and not self.rules:
            raise ValueError("method rules needs a non-empty experts.rules list")
        if self.prune is not None and self.prune.by == "budget" and self.method != "budget":
            raise ValueError("prune by: budget needs experts.method budget (the budget chooses the count)")
        return self


class NonExperts(Strict):
    """Format for attention, shared experts and dense MLPs that `keep` does not name."""

    format: FormatEntry = "bf16"
    # with experts.method budget: formats the solver may give each of these tensors instead, from their
    # measured KL (calibration's per-tensor probe), trading bytes with the routed experts; the budget
    # counts them at `format`
    formats: list[FormatEntry] = Field(default_factory=list)


class Recipe(Strict):
    model: str = DEFAULT_MODEL
    output: str = "runs/out"
    target: TargetName = "vllm"
    calibration: Calibration = Field(default_factory=Calibration)
    keep: list[str] = Field(default_factory=lambda: ["router", "shared_expert_gate", "embeddings", "lm_head"])
    non_experts: NonExperts = Field(default_factory=NonExperts)
    experts: Experts = Field(default_factory=lambda: Experts(budget=Budget(bits_per_weight=5.5)))
    algorithms: dict[str, AlgorithmName] = Field(default_factory=dict)
    gptq: Gptq = Field(default_factory=Gptq)
    formats: dict[str, dict[str, Any]] = Field(default_factory=dict)
    export: Export = Field(default_factory=Export)
    evaluate: Evaluate = Field(default_factory=Evaluate)
    seed: int = 0

    @field_validator("keep")
    @classmethod
    def _check_keep(cls, value):
        for entry in value:
            if entry not in KEEP_GROUPS and not ("*" in entry or "." in entry):
                raise ValueError(
                    f"'{entry}' is not a keep entry; accepted: {', '.join(KEEP_GROUPS)}, "
                    "or a tensor-name pattern containing '*' or '.'"
                )
        return value

    @field_validator("algorithms", "formats")
    @classmethod
    def _check_format_names(cls, value):
        for name in value:
            if name not in FORMAT_NAMES:
                raise ValueError(f"'{name}' is not a format name; accepted: {', '.join(FORMAT_NAMES)}")
        return value

    @model_validator(mode="after")
    def _target_reads_the_layout(self):
        why = get_target(self.target).check(layout=layout_for(self.export.format))
        if why:
            raise ValueError(why)
        return self

    def algorithm_for(self, format_name: str) -> str:
        """The registered algorithm (moequant.algorithms.registry) that quantizes `format_name`: the
        recipe's `algorithms:` choice, else the family's default; "none" for an unquantized format."""
        family = REGISTRY[format_name]
        if not family.quantized:
            return "none"
        return self.algorithms.get(format_name, family.default_algorithm(format_name))


# ---------------------------------------------------------------------------------------------
# Loading, overrides and error sentences


def _dotted(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


_SHORT = reprlib.Repr()  # attributes, not keywords: Python 3.10 / 3.11
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxdict = 4
_SHORT.maxlevel = 2


def _show(value: Any) -> str:
    """The bad value, shortened: a YAML alias bomb or a huge list must not become a huge sentence."""
    return f"'{value}'" if isinstance(value, str) and len(value) <= 60 else _SHORT.repr(value)


def _accepted_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the pydantic model that `loc` (minus its last part) points into."""
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        for sub in [*candidates, *[a for c in candidates for a in getattr(c, "__args__", ())]]:
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                model = sub
                break
        else:
            return []
    return list(model.model_fields)


def _sentence(source: str, error: dict, overrides: list[str] = ()) -> str:
    """One sentence for the first pydantic error: key, bad value, what is accepted. A key that a
    `--set` override wrote (or wrote the mapping around) is that override's error, not the file's."""
    key = re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], _dotted(error["loc"]))  # one line
    kind = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    where = f"recipe {source}"
    loc = tuple(error["loc"])
    for text in reversed(list(overrides)):  # the last override of a key is the one that stands
        path = tuple(_parse_override(source, text)[0])
        if loc[: len(path)] == path:
            where = f"--set {text} (on recipe {source})"
            break
    if kind == "extra_forbidden":
        accepted = _accepted_keys(Recipe, error["loc"])
        return f"{where}: unknown key '{key}'; accepted keys here: {', '.join(accepted)}."
    if kind == "missing":
        return f"{where}: key '{key}' is required."
    if kind == "literal_error":
        return f"{where}: key '{key}' has value {_show(value)}; accepted: {ctx.get('expected')}."
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"{where}: key '{key}' has value {_show(value)}; accepted: a whole number."
    if kind in ("float_parsing", "float_type"):
        return f"{where}: key '{key}' has value {_show(value)}; accepted: a number."
    if kind in ("bool_parsing", "bool_type"):
        return f"{where}: key '{key}' has value {_show(value)}; accepted: true or false."
    if kind in ("string_type",):
        return f"{where}: key '{key}' has value {_show(value)}; accepted: a string."
    if kind in ("list_type",):
        return f"{where}: key '{key}' has value {_show(value)}; accepted: a list."
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"{where}: key '{key}' has value {_show(value)}; accepted: a mapping."
    if kind == "greater_than":
        return f"{where}: key '{key}' has value {_show(value)}; accepted: a number greater than {ctx['gt']:g}."
    if kind == "greater_than_equal":
        return f"{where}: key '{key}' has value {_show(value)}; accepted: a number of at least {ctx['ge']:g}."
    if kind == "less_than_equal":
        return f"{where}: key '{key}' has value {_show(value)}; accepted: a number of at most {ctx['le']:g}."
    if kind == "value_error":
        message = str(ctx.get("error", error["msg"]))
        return f"{where}: key '{key}': {message}." if key else f"{where}: {message}."
    return f"{where}: key '{key}' has value {_show(value)}: {error['msg']}."


def _parse_override(source: str, text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise UserError(
            f"override {text!r} is not of the form dotted.key=value (e.g. experts.budget.bits_per_weight=4.5)."
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_-]+)*", key):
        raise UserError(f"override {text!r} has key {key!r}, which is not a dotted key such as experts.method.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError):  # PyYAML: chr() of a bad \U escape; deep nesting
        raise UserError(f"override {text!r}: value {raw!r} is not valid YAML.") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str], source: str = "<overrides>") -> dict:
    """Return a copy of `data` with each `dotted.key=value` set (intermediate mappings created)."""
    data = copy.deepcopy(data)
    for text in overrides or []:
        path, value = _parse_override(source, text)
        node = data
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(
                    f"override {text!r}: key '{'.'.join(path[: depth + 1])}' holds "
                    f"{_show(child)}, not a mapping, so it has no key '{path[depth + 1]}'."
                )
            node = child
        node[path[-1]] = value
    return data


def recipe_from_dict(data: Any, source: str = "<recipe>", overrides: list[str] = ()) -> Recipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(
            f"recipe {source}: the top level is {type(data).__name__}, but a mapping of keys (model, target, experts, ...) is accepted."
        )
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as error:
        raise UserError(_sentence(source, error.errors()[0], overrides)) from None
    check_format_params(recipe, source)
    return recipe


def _scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 100)


def check_format_params(recipe: Recipe, source: str) -> None:
    """Build every format the recipe names, so bad `formats` params fail at load time."""

    for name, params in recipe.formats.items():  # plain values only: they reach error sentences and plan.json
        for key, value in params.items():
            if not (_scalar(value) or (isinstance(value, list) and len(value) <= 4 and all(map(_scalar, value)))):
                raise UserError(
                    f"recipe {source}: key 'formats.{name}.{key}' has value {_show(value)}; accepted: "
                    "a number, true/false, a short text or a list of up to 4 of them."
                )
    entries = [(f"formats.{name}", name) for name in recipe.formats]
    entries.append(("non_experts.format", recipe.non_experts.format))
    entries += [(f"non_experts.formats[{i}]", f) for i, f in enumerate(recipe.non_experts.formats)]
    entries += [(f"experts.formats[{i}]", f) for i, f in enumerate(recipe.experts.formats)]
    if recipe.experts.format:
        entries.append(("experts.format", recipe.experts.format))
    for i, rule in enumerate(recipe.experts.rules or []):
        entries.append((f"experts.rules[{i}].format", rule.format))
    for key, entry in entries:
        try:
            resolve_format(recipe, entry)
        except UserError as error:
            raise UserError(f"recipe {source}: key '{key}' ({entry}): {str(error).rstrip('.')}.") from None


BUNDLED_RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def bundled_recipe(path: str | Path) -> Path:
    """`path` itself, or, when no such file exists and it is a bare name (`selective`, `uniform-int4.yaml`),
    the recipe of that name shipped with moequant."""
    path = Path(path)
    if not path.is_file() and path.parent == Path(".") and path.suffix in ("", ".yaml"):
        shipped = BUNDLED_RECIPES / f"{path.stem}.yaml"
        if shipped.is_file():
            return shipped
    return path


def _yaml_where(error) -> str:
    """' at line N: what is wrong' for a PyYAML error. An unclosed { or [ is noticed at the next token,
    often on a later line: it is reported at the line of the bracket left open."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    context, opened = getattr(error, "context", None) or "", getattr(error, "context_mark", None)
    if context.startswith("while parsing a flow") and opened is not None:
        mark, problem = opened, f"the {context.removeprefix('while parsing a ')} opened there is not closed ({problem})"
    if mark is None:
        return ""
    return f" at line {mark.line + 1}" + (f": {problem}" if problem else "")


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read a recipe YAML (None: all defaults), apply `dotted.key=value` overrides, validate."""
    if path is None:
        data, source = {}, "<defaults>"
    else:
        path = bundled_recipe(path)
        source = str(path)
        if not path.is_file():
            names = ", ".join(sorted(p.stem for p in BUNDLED_RECIPES.glob("*.yaml")))
            bare = path.parent == Path(".")  # a name, perhaps meant as a bundled recipe's
            raise UserError(
                f"recipe {source} does not exist or is not a file"
                + (f" (bundled recipes, by name: {names})." if bare else ".")
            )
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"recipe {source} is not UTF-8 text.") from None
        except yaml.YAMLError as error:
            raise UserError(f"recipe {source} is not valid YAML{_yaml_where(error)}.") from None
        except (ValueError, RecursionError):  # PyYAML: chr() of a bad \U escape; nesting deeper than Python's stack
            raise UserError(f"recipe {source} is not valid YAML (a bad escape or nesting too deep).") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise UserError(
                f"recipe {source}: the top level is {type(data).__name__}, but a mapping of keys (model, target, experts, ...) is accepted."
            )
    return recipe_from_dict(apply_overrides(data, overrides or [], source), source, overrides or [])


def recipe_to_dict(recipe: Recipe) -> dict:
    """Plain JSON-able dict (for plan.json and reports); `experts.prune` only when set and `gptq.gpu_math` only
    with its switches set away from their defaults, so a recipe without them writes the plan.json and run
    fingerprint it always did."""
    data = recipe.model_dump(mode="json")
    changed = recipe.gptq.gpu_math.changed()
    data["gptq"]["gpu_math"] = changed
    if not changed:
        del data["gptq"]["gpu_math"]
    if data["experts"].get("prune") is None:
        del data["experts"]["prune"]
    elif data["experts"]["prune"]["by"] is None:  # a count or fraction: the dict it was before `by` existed
        del data["experts"]["prune"]["by"]
    return data


def resolve_format(recipe: Recipe, entry: str):
    """A recipe format entry -> spec: an exact key as is, a bare name with the recipe's params."""
    if is_format_key(entry):
        return parse_key(entry)
    return get_format(entry, **recipe.formats.get(entry, {}))
