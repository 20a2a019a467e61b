"""The image runner (``agent.runner: local`` with ``agent.image`` or ``agent.image_field``): each attempt in
the sandbox of :mod:`.sandboxed`, with a container image's root filesystem as ``/``.

Images are read and unpacked by :mod:`lgt.trainer.rollout.images` (into its cache, once per image) before
the first attempt: the run's ``agent.image`` when the runner is checked, every task's own image by
:func:`check_task_images` (``lgt-train run``'s preflight). An image a task names that cannot be used
then is that attempt's recorded failure.

An attempt's folder (``<run_dir>/rollouts/work/<rollout>~<attempt>``), made in a thread when the attempt
has its slot (queued attempts hold no copies), holds:

* ``tree/`` — a copy of what the image holds at its working folder (``WorkingDir``, else ``/work``),
  bound writable there: the agent's own, and what the evaluator grades;
* ``home/`` — ``/lgt/work``, its ``HOME``, with ``.lgt/task.json``, the proxy's CA (``.lgt/ca.pem``) and its
  reward file;
* ``skel/`` — the mount points the image lacks (``/lgt/work``, the system CA stores, ``agent.mounts``),
  laid as a read-only layer over the image's root (an overlay), so the cache is never changed;
* ``grade/`` — the evaluator's ``/lgt/work`` (the whole task, the agent's stdout), made after the agent
  exited.

The root is read-only; the proxy's CA is bound over the system CA stores (:data:`CA_STORES`) as well as
named by the CA variables; ``agent.mounts`` (host path → path in the image) are bound read-only. The
agent's environment is the image's ``Env`` with the rollout's variables over it — nothing of the
host's. The evaluator runs in the same image after the agent exits, on the agent's ``tree/`` (the
files it names on the host, its script say, bound read-only in its sandbox only), with no network.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from lgt.proxy import auth
from lgt.trainer.rollout import images
from lgt.trainer.rollout import sandbox as sandboxing
from lgt.trainer.rollout.agent import (
    RESERVED_VARS,
    AgentSpec,
    RolloutError,
    check_env_refs,
    env_value,
    expand,
)
from lgt.trainer.rollout.runners.base import Attempt, Outcome
from lgt.trainer.rollout.runners.local import LocalRunner
from lgt.trainer.rollout.runners.sandboxed import SandboxedRunner, _take_reward_file

HOME = sandboxing.WORK  # /lgt/work: the attempt's HOME, its task, the proxy's CA, its reward file
# where the system's TLS libraries and tools look for their CA bundle (Debian/Ubuntu/Alpine/Arch, Fedora/
# RHEL, Alpine/BSD-style, openSUSE, RHEL's extracted bundle): each is the proxy's CA in an attempt
CA_STORES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem",
             "/etc/ssl/ca-bundle.pem", "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem")
EVALUATOR = "/lgt/evaluator"  # where the evaluator's own files are, in its sandbox only
_MAX_LINKS = 40


def local_runner(agent: AgentSpec) -> type[LocalRunner]:
    """The ``local`` runner: in a container image when the agent spec names one, else sandboxed (or a
    plain process with ``agent.sandbox: none``)."""
    if agent.image is not None or agent.image_field is not None:
        return ImageRunner
    return SandboxedRunner if agent.sandbox.on else LocalRunner


def in_root(root: Path, path: str) -> str:
    """``path`` inside the image whose root is ``root``, its symlinks followed there (never out of it:
    ``..`` and absolute links stop at the root): a path with no symlink on the way."""
    todo = list(PurePosixPath("/", path).parts[1:])
    done: list[str] = []
    links = 0
    while todo:
        name = todo.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, name)
        if here.is_symlink():
            links += 1
            if links > _MAX_LINKS:
                raise images.ImageError(f"{path} goes through more than {_MAX_LINKS} symlinks in the image")
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            todo = [*PurePosixPath(target).parts[1 if target.startswith("/") else 0:], *todo]
            continue
        done.append(name)
    return "/" + "/".join(done)


def find_in_image(image: images.Image, name: str, env: Mapping[str, str], also: Iterable[str] = ()) -> bool:
    """Whether ``name`` is a program in the image (a path, or on its ``PATH``), or one of ``also`` (the
    paths mounted from the host)."""
    if "/" in name:
        full = name if name.startswith("/") else f"{images.workdir_of(image)}/{name}"
        candidates = [full]
    else:
        candidates = [f"{d}/{name}" for d in env.get("PATH", images.DEFAULT_PATH).split(":") if d]
    for c in candidates:
        if str(PurePosixPath(c)) in {str(PurePosixPath(a)) for a in also}:
            return True
        try:
            found = image.root / in_root(image.root, c).lstrip("/")
        except images.ImageError:
            continue
        if found.is_file() and os.access(found, os.X_OK):
            return True
    return False


def open_agent_image(agent: AgentSpec, ref: Any, what: str = "agent.image") -> images.Image:
    """The image ``ref`` names (a path relative to the agent's folder, or a name in a local store)
    unpacked, with the agent's command (and the evaluator's, when it is not a host file) in it;
    RolloutError (one sentence) otherwise."""
    if not isinstance(ref, str) or not ref:
        raise RolloutError(f"{what} must name an image (a path, or a name in a podman or docker store), "
                           f"not {ref!r}")
    path = Path(ref).expanduser()
    if not path.is_absolute() and agent.cwd is not None and (agent.cwd / path).exists():
        path = agent.cwd / path
    try:
        image = images.open_image(path if path.exists() else ref)
    except images.ImageError as e:
        raise RolloutError(f"{what}: {e}") from None
    env = image.config.environment()
    mounted = set(agent.mounts.values())
    if not find_in_image(image, agent.command[0], env, mounted):
        raise RolloutError(f"the agent command {agent.command[0]!r} is not in image {ref} (looked on its "
                           f"PATH {env['PATH']}) nor mounted into it (agent.mounts)")
    if agent.evaluator is not None and not _host_file(agent.evaluator[0], agent.cwd) \
            and not find_in_image(image, agent.evaluator[0], env, mounted):
        raise RolloutError(f"the evaluator command {agent.evaluator[0]!r} is neither a file here nor a "
                           f"program in image {ref} (looked on its PATH {env['PATH']})")
    try:
        images.workdir_of(image)
    except images.ImageError as e:
        raise RolloutError(str(e)) from None
    return image


def check_task_images(agent: AgentSpec, tasks: Iterable[Mapping[str, Any]]) -> None:
    """Every distinct image the run's tasks name (``agent.image_field``, else ``agent.image``) unpacked
    before the first attempt; RolloutError (one sentence, naming a task) for the first that cannot be
    used."""
    seen: set[str] = set()
    for task in tasks:
        ref = task.get(agent.image_field) if agent.image_field is not None else None
        if ref is None:
            ref = agent.image
        if ref is None:
            raise RolloutError(f"task {_task_name(task)} names no image (its field {agent.image_field!r}) "
                               f"and agent.image is not set")
        key = json.dumps(ref)
        if key in seen:
            continue
        seen.add(key)
        open_agent_image(agent, ref, f"task {_task_name(task)}'s image")


def _task_name(task: Mapping[str, Any]) -> str:
    for key in ("task_id", "id"):
        if task.get(key) not in (None, ""):
            return repr(env_value(task[key]))
    return "(no task_id)"


def _host_file(name: str, cwd: Path | None) -> Path | None:
    """``name`` as a file of this machine (relative to ``cwd``) when it names one."""
    p = Path(name)
    if not p.is_absolute():
        if cwd is None or "/" not in name and not (cwd / p).is_file():
            return None
        p = cwd / p
    return Path(os.path.normpath(p.absolute())) if p.is_file() else None  # as the zygote sees it


class ImageRunner(SandboxedRunner):
    """Sandboxed attempts with a container image's root as ``/`` (see the module docstring)."""

    def __init__(self, agent: AgentSpec, *, run_dir: Path, kill_grace_s: float = 5.0,
                 hidden: Sequence[Path] = ()) -> None:
        super().__init__(agent, run_dir=run_dir, kill_grace_s=kill_grace_s, hidden=hidden)
        self.cache = images.default_cache()
        self._images: dict[str, images.Image | str] = {}  # by ref: the image, or why it cannot be used
        self._images_lock = threading.Lock()
        self._of: dict[str, tuple[Any, str] | images.Image | str] = {}  # by attempt: its image (or ref)
        self.mounts = {self._host(src): dest for src, dest in agent.mounts.items()}
        # the evaluator's arguments that are files of this machine: bound read-only under /lgt/evaluator
        self._eval_files: dict[Path, str] = {}
        self._evaluator: tuple[str, ...] | None = None
        if agent.evaluator is not None:
            argv = []
            for arg in agent.evaluator:
                host = _host_file(arg, agent.cwd)
                if host is not None:
                    argv.append(self._eval_files.setdefault(
                        host, f"{EVALUATOR}/{len(self._eval_files)}/{host.name}"))
                else:
                    argv.append(arg)
            self._evaluator = tuple(argv)

    def _host(self, src: str) -> Path:
        p = Path(src).expanduser()
        return (p if p.is_absolute() or self.agent.cwd is None else self.agent.cwd / p).absolute()

    @classmethod
    def check(cls, agent: AgentSpec, environ: Mapping[str, str]) -> None:
        """RolloutError (one sentence) when the agent cannot start: a missing working directory or mount,
        a sandbox that cannot start, ``agent.image`` unusable or without the agent's command."""
        if agent.cwd is not None and not agent.cwd.is_dir():
            raise RolloutError(f"the agent's working directory {str(agent.cwd)!r} does not exist")
        cls._check_sandbox(agent)
        for src in agent.mounts:
            p = Path(src).expanduser()
            if not (p if p.is_absolute() or agent.cwd is None else agent.cwd / p).exists():
                raise RolloutError(f"agent mount {src!r} does not exist")
        given = {"HOME": HOME, "LGT_WORK_DIR": "", "PATH": ""}  # what an attempt has besides its image's Env
        if agent.image is not None:
            given.update(open_agent_image(agent, agent.image).config.environment())
        check_env_refs(agent, given)

    # -- an attempt --------------------------------------------------------------------------------
    def _image(self, ref: Any, what: str) -> images.Image | str:
        key = json.dumps(ref)
        with self._images_lock:
            if key not in self._images:
                try:
                    self._images[key] = open_agent_image(self.agent, ref, what)
                except RolloutError as e:
                    self._images[key] = str(e)
            return self._images[key]

    def place(self, a: Attempt, filename: str, data: bytes) -> str:
        a.files[filename] = data
        return f"{HOME}/.lgt/{filename}"

    def prepare(self, a: Attempt) -> None:
        """Which image the attempt runs in; its folder, its copy of the image's working folder and its
        environment are made when it has its slot (:meth:`run`), off the event loop, so queued attempts
        hold no copies."""
        task = json.loads(a.paths.task_json.read_bytes())
        ref = task.get(self.agent.image_field) if self.agent.image_field is not None else None
        what = f"task {_task_name(task)}'s image" if ref is not None else "agent.image"
        ref = ref if ref is not None else self.agent.image
        self._of[a.name] = (ref, what) if ref is not None else (
            f"task {_task_name(task)} names no image (its field {self.agent.image_field!r}) and agent.image "
            "is not set")
        a.work = self.work_root / a.name

    def _start(self, a: Attempt) -> images.Image | str:
        """(In a thread) the attempt's image (unpacked at its first use when no check did it before), its
        environment and its folder; or why it cannot run."""
        picked = self._of.get(a.name, "the attempt was not prepared")
        image = picked if isinstance(picked, str) else self._image(*picked)
        self._of[a.name] = image
        if isinstance(image, str):
            return image
        lgt = f"{HOME}/.lgt"
        env: dict[str, str] = {"HOME": HOME, "LGT_WORK_DIR": images.workdir_of(image)}
        proxy_env = a.proxy.rollout_env(a.rollout_id, a.attempt, self.agent.proxy_mode, greedy=a.greedy,
                                        host="127.0.0.1")
        env.update({k: f"{lgt}/ca.pem" if k in auth.CA_VARS else v for k, v in proxy_env.items()})
        env.update(a.fields)
        env.update(TASK_JSON=f"{lgt}/task.json", TASK_ID=a.task_id, REWARD_FILE=f"{lgt}/reward")
        env = image.config.environment(env)
        try:
            env.update({k: expand(v, env, k) for k, v in self.agent.env.items()})
        except RolloutError as e:
            return str(e)
        env.update(a.extra_env)
        a.env = env
        self._make_image_work(a, image)
        return image

    def _make_image_work(self, a: Attempt, image: images.Image) -> None:
        assert a.work is not None
        work = a.work
        self.work_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.work_root, 0o711)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True, mode=0o700)
        home = work / "home"
        (home / ".lgt").mkdir(parents=True)
        proxy = a.proxy
        if proxy.port not in self._ca_pem:
            self._ca_pem[proxy.port] = Path(proxy.rollout_env(a.rollout_id, 0)["SSL_CERT_FILE"]).read_bytes()
        (home / ".lgt" / "task.json").write_bytes(a.agent_json)
        (home / ".lgt" / "ca.pem").write_bytes(self._ca_pem[proxy.port])
        for name, data in a.files.items():
            (home / ".lgt" / name).write_bytes(data)
        images.fresh_workdir(image, work / "tree")
        (work / "mnt").mkdir()
        _own(home, work / "tree")

    def _request(self, a: Attempt, image: images.Image, binds: Sequence[tuple[str, str, bool, bool]],
                 skel: str) -> dict:
        """What sandbox_init is told: the overlay's layers, and each bind ``(source as the zygote sees it,
        path in the image, writable, a folder)`` at its path resolved in the image, whose missing mount
        points the skeleton ``skel`` (a folder of the attempt's) holds."""
        assert a.work is not None
        inside = f"{sandboxing.ATTEMPTS}/{a.name}"
        resolved = [in_root(image.root, dest) for _, dest, _, _ in binds]
        _skeleton(a.work / skel, image.root, [(r, b[3]) for r, b in zip(resolved, binds)])
        return {"work": a.name, "image": {
            "mount": f"{inside}/mnt", "lower": [f"{inside}/{skel}", str(image.root)],
            "binds": [[src, r, writable] for r, (src, _, writable, _) in zip(resolved, binds)]}}

    async def run(self, a: Attempt) -> Outcome:
        image = await asyncio.to_thread(self._start, a)
        if isinstance(image, str):
            return Outcome(None, False, image)
        inside = f"{sandboxing.ATTEMPTS}/{a.name}"
        binds = [(f"{inside}/tree", images.workdir_of(image), True, True),
                 (f"{inside}/home", HOME, True, True)]
        binds += [(f"{inside}/home/.lgt/ca.pem", store, False, False) for store in CA_STORES]
        binds += [(str(src), dest, False, src.is_dir()) for src, dest in self.mounts.items()]
        return await self._spawn(a, self.agent.command, self._request(a, image, binds, "skel"),
                                 name=self.agent.command[0], execute=True, cwd=images.workdir_of(image))

    def collect(self, a: Attempt) -> None:
        assert a.work is not None
        _take_reward_file(a.work / "home", a.paths.reward_file)

    async def evaluate(self, a: Attempt, env: Mapping[str, str]) -> Outcome:
        """The evaluator in the attempt's image, on the folder the agent left (its ``tree/``), with the
        whole task; no network; the host files it names bound read-only in its sandbox only."""
        assert self._evaluator is not None and a.work is not None
        image = self._of[a.name]
        assert isinstance(image, images.Image)
        grade = a.work / "grade"
        shutil.rmtree(grade, ignore_errors=True)
        (grade / ".lgt").mkdir(parents=True)
        shutil.copyfile(a.paths.task_json, grade / ".lgt" / "task.json")
        if a.paths.stdout.exists():
            shutil.copyfile(a.paths.stdout, grade / ".lgt" / "stdout")
        else:
            (grade / ".lgt" / "stdout").touch()
        (a.work / "mnt").mkdir(exist_ok=True)
        _own(grade)
        inside = images.workdir_of(image)
        eval_env = {k: v for k, v in env.items()
                    if k.startswith(self.agent.task_env_prefix) or k in RESERVED_VARS
                    or k in ("LGT_ROLLOUT_ID", "LGT_ATTEMPT")}
        eval_env.update(TASK_JSON=f"{HOME}/.lgt/task.json", HOME=HOME, LGT_WORK_DIR=inside)
        eval_env.pop("REWARD_FILE", None)
        eval_env = image.config.environment(eval_env)
        root = f"{sandboxing.ATTEMPTS}/{a.name}"
        binds = [(f"{root}/tree", inside, True, True), (f"{root}/grade", HOME, True, True)]
        binds += [(str(f), dest, False, False) for f, dest in self._eval_files.items()]
        request = self._request(a, image, binds, "gskel")
        argv = (*self._evaluator, f"{HOME}/.lgt/task.json", f"{HOME}/.lgt/stdout")
        return await self._spawn(a, argv, request, name=self._evaluator[0], execute=True, cwd=inside,
                                 env=eval_env, relay=False, out=(a.paths.eval_out, a.paths.eval_err))

    async def release(self, a: Attempt) -> None:
        self._of.pop(a.name, None)
        await super().release(a)

    # -- the zygote --------------------------------------------------------------------------------
    def _layout(self, python: str) -> sandboxing.Layout:
        """What the zygote's sandbox shows: its interpreter, the image cache's roots, ``agent.mounts``
        and the evaluator's files (read-only), the attempts' folders; nothing else of this machine."""
        roots = self.cache / "roots"
        roots.mkdir(parents=True, exist_ok=True)
        readonly = [*sandboxing.interpreter_dirs(python), roots, *self.mounts, *self._eval_files]
        readonly = [Path(os.path.normpath(p.absolute())) for p in readonly]
        readonly += [p.resolve() for p in readonly if p.resolve() != p]
        layout = sandboxing.Layout(readonly=readonly, hidden=list(self.hidden), attempts=self.work_root,
                                   cwd=None)
        self.work_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.work_root, 0o711)
        return layout


def _skeleton(skel: Path, root: Path, targets: Iterable[tuple[str, bool]]) -> None:
    """In ``skel`` (a layer over the image's root), what each target (a path resolved in the image, a
    folder or a file) lacks there: its missing folders, and itself as an empty folder or file."""
    skel.mkdir(exist_ok=True)
    for target, is_dir in targets:
        parts = PurePosixPath(target).parts[1:]
        for i, _ in enumerate(parts):
            rel = Path(*parts[: i + 1])
            last = i == len(parts) - 1
            if os.path.lexists(root / rel):
                continue
            if last and not is_dir:
                (skel / rel).parent.mkdir(parents=True, exist_ok=True)
                (skel / rel).touch()
            else:
                (skel / rel).mkdir(mode=0o755, parents=True, exist_ok=True)


def _own(*paths: Path) -> None:
    """The attempt's folders (everything in them) owned by the sandbox's user outside, when lgt runs as
    root; folders searchable."""
    uid = sandboxing.sandbox_uid()
    for top in paths:
        os.chmod(top, 0o755)
        if uid is None:
            continue
        for here, dirs, files in os.walk(top):
            os.lchown(here, uid, uid)
            for name in dirs + files:
                os.lchown(os.path.join(here, name), uid, uid)
