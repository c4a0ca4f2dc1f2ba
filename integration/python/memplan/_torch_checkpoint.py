"""memplan.torch's checkpoints (a private module of memplan.torch): writing and reading
safetensors files, consolidate_checkpoint(), and OffloadedModule's state_dict / save /
load_state_dict and optimizer-state / save_checkpoint / load_checkpoint methods as a mixin class
memplan.torch.OffloadedModule inherits (it uses the fields OffloadedModule.__init__ sets)."""

import json
import os
import shutil
import tempfile

import torch

import memplan

from ._torch_common import _engine_group_options, _group_source, _torch_group_options


def _write_checkpoint(module, state, path):
    """save()'s writing, on one rank (see OffloadedModule.save)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} exists and is not a directory")
    tmp = tempfile.mkdtemp(prefix=".memplan-save-", dir=parent)
    try:
        if hasattr(module, "save_pretrained"):
            module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        else:
            from safetensors.torch import save_file
            seen = set()
            unique = {}
            for name, t in state.items():  # safetensors stores a shared tensor once
                if id(t) not in seen:
                    seen.add(id(t))
                    unique[name] = t.contiguous()
            save_file(unique, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if os.path.isdir(path):
            for name in os.listdir(tmp):
                os.replace(os.path.join(tmp, name), os.path.join(path, name))
            os.rmdir(tmp)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_STATE_NAMES = {"adam": ["exp_avg", "exp_avg_sq"], "adam-amsgrad": ["exp_avg", "exp_avg_sq",
                                                                    "max_exp_avg_sq"],
                "lion": ["exp_avg"], "sgd": ["momentum_buffer"]}


def _write_safetensors(path, items, metadata):
    """Writes a safetensors file from `items` [(name, numel, produce)], each produce() giving its
    float32 values, one at a time (so a rank's optimizer state never sits in memory whole), into a
    temporary file renamed into place."""
    import struct
    header = {"__metadata__": metadata}
    offset = 0
    for name, numel, _ in items:
        header[name] = {"dtype": "F32", "shape": [int(numel)],
                        "data_offsets": [offset, offset + 4 * int(numel)]}
        offset += 4 * int(numel)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for name, numel, produce in items:
                values = produce().detach().to("cpu", torch.float32).contiguous().reshape(-1)
                if values.numel() != numel:
                    raise ValueError(f"memplan.torch: {name}: {values.numel()} values for {numel}")
                f.write(values.numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class _CheckpointMixin:
    """OffloadedModule's state dicts and checkpoints (see the module's docstring)."""

    # ---- the module's values: state_dict and save ------------------------------------------------

    def state_dict(self, dtype=None):
        """The module's state_dict() with the engine's values: {name: CPU tensor}, parameters as
        fp32 master weights (frozen ones as held; `dtype`: cast to it, e.g. torch.bfloat16 for a
        16-bit export), buffers and parameters the engine does not hold as they are, under the
        module's own names (a tied parameter under each of its names, one tensor). With world
        size > 1 this is a collective (the shards are gathered): every rank calls it."""
        weights = self.master_weights()
        if dtype is not None:
            weights = {n: t.to(dtype) for n, t in weights.items()}
        by_param = {id(e.param): weights[e.name] for e in self.params}
        out = {}
        self._in_state_dict = True
        try:
            own = self.module.state_dict(keep_vars=True)
        finally:
            self._in_state_dict = False
        for name, t in own.items():
            out[name] = by_param[id(t)] if id(t) in by_param else t.detach().cpu()
        return out

    def save(self, path, dtype=None):
        """Writes the trained weights as safetensors into the directory `path`: for a
        Transformers model (``save_pretrained``) its own layout (config.json, model.safetensors,
        tied weights once), which ``from_pretrained`` loads; for another module
        ``model.safetensors`` with state_dict() names (tied tensors once). `dtype`
        (torch.bfloat16, torch.float16): a 16-bit export; default the fp32 master weights. Every
        rank calls it (the weights are gathered from the shards); the first rank writes, into a
        temporary directory beside `path` that is renamed into place, so a failure leaves nothing
        half written. Raises OSError on every rank if the write failed."""
        self._check_open()
        state = self.state_dict(dtype=dtype)
        error = None
        if self.rank == 0:
            try:
                _write_checkpoint(self.module, state, path)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = (type(e).__name__, str(e), getattr(e, "errno", None))
        if self.world_size > 1:
            import torch.distributed as dist
            box = [error]
            dist.broadcast_object_list(box, src=_group_source(self.group), group=self.group)
            error = box[0]
        if error is not None:
            name, text, errno = error
            raise OSError(errno, f"memplan.torch: writing the checkpoint {path} failed: "
                                 f"{name}: {text}")

    def _frozen_values(self, entry):
        """A frozen parameter's values (it has no master weights): its working copy, fetched."""
        unit = entry.units[0]
        self._fetch(unit)
        try:
            return self._view(entry).reshape(-1)[:entry.numel].to("cpu", torch.float32,
                                                                  copy=True)
        finally:
            self._release(unit)

    # ---- the module's state_dict and load_state_dict ---------------------------------------------

    def _make_state_dict_hook(self, unit):
        """Note [The module's state_dict]: module.state_dict() gives the engine's values of the
        unit's parameters (world size 1), or raises (their shards are on other ranks too)."""
        def hook(module, state_dict, prefix, local_metadata):
            if self._in_state_dict or self._closed:
                return None
            if self.world_size > 1:
                raise RuntimeError(
                    "memplan.torch: the module's parameters are sharded over "
                    f"{self.world_size} ranks, so its own state_dict() would hold none of them; "
                    "call trainer.state_dict() on every rank (a collective), or trainer.save(dir)")
            for local, entry in unit.local_names:
                key = prefix + local
                if key not in state_dict:
                    continue
                if entry.frozen:
                    values = self._frozen_values(entry)
                else:
                    values = torch.empty(entry.numel, dtype=torch.float32)
                    self.engine.read_master(entry.id, values)
                values = values.view(entry.shape) if entry.shape else values.view(())
                state_dict[key] = values.to(entry.dtype)
            return None
        return hook

    def _module_load_state_dict(self, state_dict, strict=True, assign=False):
        """The module's own load_state_dict, while the engine holds its parameters."""
        if assign:
            raise ValueError("memplan.torch: load_state_dict(assign=True) would replace the "
                             "engine's parameters; load values instead (assign=False)")
        return self.load_state_dict(state_dict, strict=strict)

    def load_state_dict(self, state_dict, strict=True):
        """Loads weights into the running engine, as module.load_state_dict would into the module
        (the module's own load_state_dict comes here while the engine holds it): parameters become
        the engine's master weights (frozen ones its values; the optimizer's states are kept, as
        torch keeps an optimizer's), buffers and parameters the engine does not hold are copied.
        Between steps. With world size > 1 every rank calls it with the same state_dict (a
        collective). Returns torch's (missing_keys, unexpected_keys); strict raises on either, and
        a shape mismatch raises always, before anything is loaded."""
        self._check_open()
        self._in_state_dict = True
        try:
            own = self.module.state_dict(keep_vars=True)
        finally:
            self._in_state_dict = False
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        errors = []
        values = {}   # entry id -> CPU float32 tensor, flattened
        copies = []   # (tensor of the module, value)
        for name, t in own.items():
            if name not in state_dict:
                continue
            value = state_dict[name]
            if not isinstance(value, torch.Tensor):
                errors.append(f"{name}: not a tensor ({type(value).__name__})")
                continue
            entry = self._by_param.get(id(t))
            shape = entry.shape if entry is not None else tuple(t.shape)
            if tuple(value.shape) != shape:
                errors.append(f"size mismatch for {name}: copying a param with shape "
                              f"{tuple(value.shape)}, the shape in the current model is "
                              f"{torch.Size(shape)}")
                continue
            if entry is not None:
                values.setdefault(entry.id, value.detach().to("cpu", torch.float32).reshape(-1))
            else:
                copies.append((t, value))
        if strict and (missing or unexpected):
            if missing:
                errors.append("Missing key(s) in state_dict: " + ", ".join(
                    f'"{k}"' for k in missing))
            if unexpected:
                errors.append("Unexpected key(s) in state_dict: " + ", ".join(
                    f'"{k}"' for k in unexpected))
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.module).__name__}:"
                               "\n\t" + "\n\t".join(errors))
        # Parameters not given keep their values: the engine replaces all of them at once, so
        # their current ones are read first (this rank's shard; a frozen one's whole values).
        shards = {}
        for entry in self.params:
            if entry.id in values:
                continue
            if entry.frozen:
                values[entry.id] = self._frozen_values(entry)
            else:
                _, size, _ = self.engine.shard(entry.id)
                current = torch.empty(size, dtype=torch.float32)
                self.engine.read_state(entry.id, 0, current)
                shards[entry.id] = current
        if len(shards) < len(self.params):
            def fill(param, array, first, count):
                if param in shards:
                    return shards[param][first:first + count]
                begin = self.engine.shard(param)[0] + first
                return values[param][begin:begin + count].contiguous()

            arrays = [True] + [False] * self.engine.optimizer_states
            self.engine.load_state(fill, arrays)
        with torch.no_grad():
            for t, value in copies:
                t.copy_(value)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    # ---- the optimizer's state: torch's form and checkpoint files --------------------------------

    def param_group_entries(self):
        """The trainable parameters of each group, in registration order: the order of an
        OffloadOptimizer's param_groups and of optimizer_state_dict()'s indices."""
        groups = [[] for _ in self.group_options]
        for entry in self.params:
            if not entry.frozen:
                groups[entry.group].append(entry)
        return groups

    def group_param_options(self, g):
        """Group g's options in torch.optim's spelling (lr, weight_decay, betas, eps, ...)."""
        options = dict(self.optimizer_options)
        options.update(self.group_options[g])
        return _torch_group_options(
            {k: v for k, v in options.items() if k not in ("grad_scale", "max_grad_norm",
                                                           "norm_type", "decoupled")},
            self.optimizer_kind)

    def _state_names(self):
        return _STATE_NAMES.get(self.optimizer_name, _STATE_NAMES["adam"])

    def optimizer_state_dict(self):
        """The optimizer's state as torch.optim's state_dict() has it ({"state": {index: {"step",
        "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}, indices in param_group_entries()
        order; Lion "exp_avg", SGD "momentum_buffer"), whole tensors on the CPU: what a
        torch.optim.AdamW over the same parameters would hold. Between steps; with world size > 1 a
        collective (each shard gathered). For a model whose states do not fit in memory, write
        them with save_checkpoint() instead."""
        self._check_open()
        names = self._state_names()
        state, groups, index = {}, [], 0
        for g, entries in enumerate(self.param_group_entries()):
            ids = []
            for entry in entries:
                _, size, numel = self.engine.shard(entry.id)
                steps = self.engine.param_step(entry.id)
                item = {"step": torch.tensor(float(steps))}
                for k, name in enumerate(names, start=1):
                    shard = torch.empty(size, dtype=torch.float32)
                    self.engine.read_state(entry.id, k, shard)
                    whole = self._gather(shard, numel)
                    item[name] = whole.view(entry.shape) if entry.shape else whole.view(())
                if steps > 0:  # torch keeps no state for a parameter never stepped
                    state[index] = item
                ids.append(index)
                index += 1
            groups.append(dict(self.group_param_options(g), params=ids))
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, state_dict):
        """Loads an optimizer state in torch.optim's form (optimizer_state_dict()'s, or a
        torch.optim.AdamW's over the same parameters in the same groups) into the running engine:
        the states, each parameter's step count and the groups' options. Between steps; with world
        size > 1 every rank calls it with the same dict. Raises ValueError, before loading
        anything, when the groups or shapes differ."""
        self._check_open()
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise ValueError("memplan.torch: an optimizer state_dict has \"state\" and "
                             "\"param_groups\"")
        groups = state_dict["param_groups"]
        mine = self.param_group_entries()
        if len(groups) != len(mine):
            raise ValueError(f"memplan.torch: the optimizer state has {len(groups)} parameter "
                             f"groups; this optimizer has {len(mine)}")
        names = self._state_names()
        saved = state_dict.get("state", {})
        by_entry = {}
        for g, (group, entries) in enumerate(zip(groups, mine)):
            if len(group["params"]) != len(entries):
                raise ValueError(f"memplan.torch: group {g} of the optimizer state has "
                                 f"{len(group['params'])} parameters; this optimizer's has "
                                 f"{len(entries)}")
            for index, entry in zip(group["params"], entries):
                item = saved.get(index, saved.get(str(index)))
                if item is not None:
                    for name in names:
                        value = item.get(name)
                        if value is None or tuple(value.shape) != entry.shape:
                            raise ValueError(
                                f"memplan.torch: the optimizer state of {entry.name} has "
                                f"{name} {None if value is None else tuple(value.shape)}; the "
                                f"parameter is {entry.shape}")
                by_entry[entry.id] = item
        options = [_engine_group_options({k: v for k, v in group.items() if k != "params"},
                                         self.optimizer_kind, f"param_groups[{g}]")
                   for g, group in enumerate(groups)]
        steps = [0] * len(self.params)
        for entry in self.params:
            item = by_entry.get(entry.id)
            if item is not None:
                steps[entry.id] = int(float(item["step"]))
        flat = {}

        def fill(param, array, first, count):
            item = by_entry.get(param)
            if item is None:
                return torch.zeros(count, dtype=torch.float32)
            key = (param, array)
            if key not in flat:
                flat[key] = item[names[array - 1]].detach().to("cpu", torch.float32).reshape(-1)
            begin = self.engine.shard(param)[0] + first
            return flat[key][begin:begin + count].contiguous()

        self.engine.load_state(fill, [False] + [True] * len(names), steps)
        self.group_options = [dict(o) for o in options]
        # The groups now carry every option; the defaults they override stay for reference.

    def save_checkpoint(self, directory):
        """Writes the optimizer's whole state (master weights, states, step counts, the groups'
        options) into `directory`, streamed parameter by parameter into one safetensors file per
        rank (``rank<r>-of-<N>.safetensors``: this rank's shard of each parameter's arrays) and
        ``memplan-checkpoint.json``, as DeepSpeed writes its own files: load_checkpoint() reads it
        back with any number of ranks, consolidate_checkpoint() gives the whole weights. Every rank
        calls it, between steps; the directory is created. Raises OSError on every rank if a
        rank's write failed, leaving no partial file of its own."""
        self._check_open()
        names = ["master"] + self._state_names()
        error = None
        try:
            os.makedirs(directory, exist_ok=True)
            items, params = [], {}
            for entry in self.params:
                if entry.frozen:
                    continue
                first, size, numel = self.engine.shard(entry.id)
                real = max(0, min(size, numel - first))
                for k, name in enumerate(names):
                    def produce(param=entry.id, array=k, size=size, real=real):
                        shard = torch.empty(size, dtype=torch.float32)
                        self.engine.read_state(param, array, shard)
                        return shard[:real]
                    items.append((f"{entry.name}.{name}", real, produce))
                params[entry.name] = {"shape": list(entry.shape), "numel": numel, "first": first,
                                      "size": real, "step": self.engine.param_step(entry.id),
                                      "group": entry.group, "dtype": str(entry.dtype)}
            meta = {"format": "memplan-optimizer-checkpoint", "version": 1, "rank": self.rank,
                    "world_size": self.world_size, "optimizer": self.optimizer_name,
                    "arrays": names, "params": params, "groups": self.group_options,
                    "options": {k: v for k, v in self.optimizer_options.items()
                                if isinstance(v, (int, float, bool, str))}}
            _write_safetensors(os.path.join(directory,
                                            f"rank{self.rank}-of-{self.world_size}.safetensors"),
                               items, {"memplan": json.dumps(meta)})
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = (type(e).__name__, str(e), getattr(e, "errno", None))
        error = self._first_error(error)
        if error is None and self.rank == 0:
            try:
                manifest = {"format": "memplan-optimizer-checkpoint", "version": 1,
                            "world_size": self.world_size, "optimizer": self.optimizer_name,
                            "arrays": names, "groups": self.group_options}
                tmp = os.path.join(directory, f".memplan-checkpoint.json.{os.getpid()}")
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(manifest, f)
                os.replace(tmp, os.path.join(directory, "memplan-checkpoint.json"))
            except OSError as e:
                error = (type(e).__name__, str(e), e.errno)
        error = self._first_error(error, source=True)
        if error is not None:
            name, text, errno = error
            raise OSError(errno, f"memplan.torch: writing the optimizer checkpoint {directory} "
                                 f"failed: {name}: {text}")

    def _first_error(self, error, source=False):
        """With world size > 1, the first rank's error (or the first rank's only, `source`), on
        every rank."""
        if self.world_size == 1:
            return error
        import torch.distributed as dist
        if source:
            box = [error]
            dist.broadcast_object_list(box, src=_group_source(self.group), group=self.group)
            return box[0]
        errors = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        return next((e for e in errors if e is not None), None)

    def load_checkpoint(self, directory):
        """Loads what save_checkpoint() wrote (with any number of ranks) into the running engine:
        master weights, optimizer states, step counts, the groups' options. Every rank calls it,
        between steps. Raises ValueError naming the first difference when the checkpoint is of
        other parameters (names, shapes) or another optimizer, FileNotFoundError when a file is
        missing; nothing is loaded then."""
        self._check_open()
        files = _CheckpointFiles(directory)
        try:
            names = ["master"] + self._state_names()
            if files.optimizer != self.optimizer_name or files.arrays != names:
                raise ValueError(f"memplan.torch: {directory} holds a {files.optimizer} "
                                 f"checkpoint ({', '.join(files.arrays)}); this engine runs "
                                 f"{self.optimizer_name}")
            steps = [0] * len(self.params)
            for entry in self.params:
                if entry.frozen:
                    continue
                meta = files.params.get(entry.name)
                if meta is None:
                    raise ValueError(f"memplan.torch: {directory} has no {entry.name}")
                if tuple(meta["shape"]) != entry.shape:
                    raise ValueError(f"memplan.torch: {entry.name} is {tuple(meta['shape'])} in "
                                     f"{directory}; the model's is {entry.shape}")
                steps[entry.id] = int(meta["step"])
            extra = sorted(set(files.params) - {e.name for e in self.params if not e.frozen})
            if extra:
                raise ValueError(f"memplan.torch: {directory} holds {extra[0]}, which this model "
                                 "does not train")
            by_id = {e.id: e for e in self.params}

            def fill(param, array, first, count):
                begin = self.engine.shard(param)[0] + first
                return files.read(by_id[param].name, names[array], begin, count)

            self.engine.load_state(fill, [True] * len(names), steps)
            if len(files.groups) == len(self.group_options):
                self.group_options = [dict(g) for g in files.groups]
        finally:
            files.close()


class _CheckpointFiles:
    """The files save_checkpoint() wrote, read lazily (safetensors slices)."""

    def __init__(self, directory):
        path = os.path.join(directory, "memplan-checkpoint.json")
        try:
            manifest = memplan._load_json_arg(path)
        except FileNotFoundError:
            raise FileNotFoundError(
                2, f"memplan.torch: {directory} holds no memplan optimizer checkpoint "
                   "(memplan-checkpoint.json; OffloadedModule.save_checkpoint writes it)", path)
        except json.JSONDecodeError as e:
            raise ValueError(f"memplan.torch: {path}: not JSON ({e})") from None
        if manifest.get("format") != "memplan-optimizer-checkpoint" or manifest.get("version") != 1:
            raise ValueError(f"memplan.torch: {path}: not a memplan optimizer checkpoint of "
                             "version 1")
        self.directory = directory
        self.world_size = int(manifest["world_size"])
        self.optimizer = manifest["optimizer"]
        self.arrays = list(manifest["arrays"])
        self.groups = manifest.get("groups", [])
        self.params = {}   # name -> {"shape", "numel", "step", "group", "pieces": [(rank, first,
        self._open = {}    # size)]}; rank -> safe_open handle
        from safetensors import safe_open
        self._safe_open = safe_open
        for rank in range(self.world_size):
            meta = json.loads(self._file(rank).metadata()["memplan"])
            for name, p in meta["params"].items():
                item = self.params.setdefault(name, dict(p, pieces=[]))
                item["pieces"].append((rank, int(p["first"]), int(p["size"])))

    def _file(self, rank):
        if rank not in self._open:
            path = os.path.join(self.directory, f"rank{rank}-of-{self.world_size}.safetensors")
            if not os.path.exists(path):
                raise FileNotFoundError(2, f"memplan.torch: the optimizer checkpoint lacks {path}",
                                        path)
            self._open[rank] = self._safe_open(path, framework="pt")
        return self._open[rank]

    def read(self, name, array, begin, count):
        """Elements [begin, begin + count) of the flattened `array` of parameter `name`."""
        parts = []
        end = begin + count
        for rank, first, size in self.params[name]["pieces"]:
            a, b = max(begin, first), min(end, first + size)
            if a < b:
                parts.append(self._file(rank).get_slice(f"{name}.{array}")[a - first:b - first])
        values = torch.cat(parts) if len(parts) > 1 else parts[0]
        if values.numel() != count:
            raise ValueError(f"memplan.torch: {self.directory}: {name}.{array} holds "
                             f"{values.numel()} of elements [{begin}, {end})")
        return values.to(torch.float32).contiguous()

    def close(self):
        self._open.clear()


def consolidate_checkpoint(directory, output=None, dtype=torch.float32):
    """The whole fp32 master weights of an optimizer checkpoint (OffloadedModule.save_checkpoint,
    written by any number of ranks), as {name: tensor} in `dtype` (torch.bfloat16 for a 16-bit
    export), like DeepSpeed's zero_to_fp32; with `output`, also written there as
    model.safetensors. Names are the registered ones (a tied parameter once, under its first
    name). Needs no GPU and no engine."""
    files = _CheckpointFiles(directory)
    try:
        state = {}
        for name, meta in files.params.items():
            values = files.read(name, "master", 0, int(meta["numel"]))
            state[name] = values.view(tuple(meta["shape"])).to(dtype)
    finally:
        files.close()
    if output is not None:
        from safetensors.torch import save_file
        os.makedirs(output, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    return state
