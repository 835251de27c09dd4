"""docs/deployment.md's layouts are real: every `leto` command line in its manifests and scripts
parses with leto's own parser, each flag spelled out in full, and yields a valid job
configuration; a host that joins or stands by runs the job's command line otherwise unchanged;
the Kubernetes manifests are valid YAML in the layout the page describes, and the shell scripts
are valid bash. Nothing is run and nothing is contacted: host names resolve through a stand-in."""

from __future__ import annotations

import argparse
import re
import shlex
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml  # PyYAML comes with the dev extras (transformers, huggingface_hub)

from leto import cli
from leto.config import JobConfig
from leto.errors import UsageError

DOC = Path(__file__).resolve().parent.parent / "docs" / "deployment.md"

# What the scripts take from outside: Slurm's variables and the replacement job's --export.
SCRIPT_ENV = {"SLURM_JOB_ID": "4242", "SLURM_CPUS_ON_NODE": "64", "LETO_JOB": "gpt-4242"}
SHELLS = ("sh", "bash")
CONTROL = {"&", "&&", "||", ";", "|", ";;", "(", ")"}  # where a shell command line ends
LAYOUTS = ("Kubernetes", "Slurm")  # the sections that must show a host, a replacement and a standby
ROLE_FLAGS = ("--join", "--standby")  # what may differ between a job's hosts


@dataclass(frozen=True)
class Block:
    lang: str  # the fence's info string ("" for none)
    text: str
    section: str  # the `## ` heading it is under
    line: int  # where it starts in the page


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]  # after `leto`
    section: str
    where: str  # "deployment.md:LINE"


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of a markdown page."""
    found, section, opened, lang, body = [], "", None, "", []
    for n, line in enumerate(page.splitlines(), 1):
        if opened is None and line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("```") and opened is None:
            opened, lang, body = n, line[3:].strip(), []
        elif line.startswith("```"):
            found.append(Block(lang, "\n".join(body), section, opened))
            opened = None
        elif opened is not None:
            body.append(line)
    if opened is not None:
        raise ValueError(f"deployment.md:{opened}: a code block is never closed")
    return found


def _is_leto(word: str) -> bool:
    return word == "leto" or word.endswith("/leto")


def _expand(word: str, env: dict[str, str], where: str) -> str:
    """`$NAME` and `${NAME}` from `env`; any other expansion is refused (it would need a shell)."""

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            raise ValueError(f"{where}: ${name} is neither set by the script's environment nor documented")
        return env[name]

    out = re.sub(r"\$\{(\w+)\}|\$(\w+)", one, word)
    if "$" in out or "`" in out:
        raise ValueError(f"{where}: {word!r} needs a shell to expand; write the value out")
    return out


def shell_commands(script: str, env: dict[str, str], where: str) -> list[tuple[str, ...]]:
    """The `leto ...` command lines of a shell script: each from a `leto` word to the end of its
    shell command, with its variables expanded from `env`."""
    found = []
    for logical in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(logical, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
        for i, word in enumerate(words):
            if _is_leto(word):
                rest = words[i + 1 :]
                end = next((j for j, w in enumerate(rest) if w in CONTROL or w[0] in "<>"), len(rest))
                found.append(tuple(_expand(w, env, where) for w in rest[:end]))
    return found


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec") or {}
    pod = (spec.get("template") or {}).get("spec") or spec
    return list(pod.get("containers") or [])


def yaml_commands(doc: dict, where: str) -> list[tuple[str, ...]]:
    """The `leto ...` command lines of a manifest's containers: `command` + `args`, or the script of
    a `sh -c` command. `$(NAME)` expands from the container's literal `env` values, as Kubernetes
    does."""
    found = []
    for c in _containers(doc):
        env = {e["name"]: e["value"] for e in c.get("env") or [] if "value" in e}
        words = [*(c.get("command") or []), *(c.get("args") or [])]
        line = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(w)) for w in words]
        if line and _is_leto(line[0]):
            found.append(tuple(_expand(w, {}, where) for w in line[1:]))
        elif len(line) >= 3 and Path(line[0]).name in SHELLS and line[1] == "-c":
            found += shell_commands(line[2], SCRIPT_ENV, where)
    return found


def manifests(page: str) -> list[tuple[Block, dict]]:
    return [(b, doc) for b in blocks(page) if b.lang == "yaml" for doc in yaml.safe_load_all(b.text) if doc]


def commands(page: str) -> list[Command]:
    """Every `leto ...` command line of the page's examples."""
    found = []
    for b in blocks(page):
        where = f"deployment.md:{b.line}"
        if b.lang == "yaml":
            lines = [argv for doc in yaml.safe_load_all(b.text) if doc for argv in yaml_commands(doc, where)]
        elif b.lang in ("", *SHELLS):
            lines = shell_commands(b.text, SCRIPT_ENV, where)
        else:
            raise ValueError(f"{where}: a code block in {b.lang!r}, which this test does not read")
        found += [Command(argv, b.section, where) for argv in lines]
    return found


def _strict_parser() -> cli._Parser:
    """leto's own parser, taking no abbreviation: a flag the docs shorten is one they misspell."""
    parser = cli.build_parser()
    for sub in parser.commands.values():
        sub.allow_abbrev = False
    return parser


def _resolve_nothing(host: str, port: object, *args: object, **kwargs: object) -> list:
    """getaddrinfo's stand-in: every name is a documentation name; nothing is looked up."""
    return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("192.0.2.1", int(port)))]


def check(argv: tuple[str, ...]) -> tuple[argparse.Namespace, JobConfig | None]:
    """Parse one `leto` command line as the CLI does and check it as a job's flags are checked
    before the job starts; a job command's configuration is built. Raises UsageError."""
    parser = _strict_parser()
    args = parser.parse_args(list(argv))
    if args.cmd not in parser.commands:
        return args, None
    with mock.patch.object(socket, "getaddrinfo", _resolve_nothing):
        cli._check_job(args, f"leto {args.cmd}")
    script = [args.script, *args.script_args] if args.cmd == "run" else ["-m", "leto.training.train_gpt"]
    return args, cli._config(args, script, getattr(args, "steps", None))


PAGE = DOC.read_text()
COMMANDS = commands(PAGE)


def test_the_page_documents_a_host_a_replacement_and_a_standby_in_each_layout() -> None:
    for layout in LAYOUTS:
        lines = [c.argv for c in COMMANDS if c.section == layout]
        plain = [a for a in lines if not set(ROLE_FLAGS) & set(a)]
        assert plain, f"deployment.md, {layout}: no `leto` command line of the job's own hosts"
        for flag in ROLE_FLAGS:
            assert any(flag in a for a in lines), f"deployment.md, {layout}: no host started with {flag}"


def test_leto_has_every_flag_the_page_uses() -> None:
    parser = _strict_parser()
    missing = set()
    for c in COMMANDS:
        sub = parser.commands.get(c.argv[0]) if c.argv else None
        if sub is not None:
            _, unknown = sub.parse_known_args(list(c.argv[1:]))  # a script's own flags are its arguments
            missing |= {f"leto {c.argv[0]} {w.split('=', 1)[0]} ({c.where})" for w in unknown if w.startswith("-")}
    assert not missing, "deployment.md uses flags leto does not have: " + ", ".join(sorted(missing))


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.section}:{c.where.split(':')[1]}")
def test_a_documented_command_parses_and_yields_a_valid_config(command: Command) -> None:
    try:
        args, config = check(command.argv)
    except UsageError as e:
        pytest.fail(f"{command.where} (section {command.section}): leto {shlex.join(command.argv)}\n  {e}")
    assert args.cmd in ("run", "train")
    assert config is not None and JobConfig.from_json(config.to_json()) == config
    if command.section in LAYOUTS:
        assert config.rendezvous.url is not None and config.rendezvous.job_id, command.where
        for flag in ROLE_FLAGS:
            assert getattr(config.rendezvous, flag[2:], False) == (flag in command.argv), command.where


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layouts_hosts_run_one_command_line_but_for_join_and_standby(layout: str) -> None:
    seen = {}
    for c in (c for c in COMMANDS if c.section == layout):
        args, _ = check(c.argv)
        flags = {k: v for k, v in vars(args).items() if k not in {f.lstrip("-") for f in ROLE_FLAGS}}
        seen[c.where] = flags
    first = next(iter(seen.values()))
    for where, flags in seen.items():
        differ = sorted(k for k in first.keys() | flags.keys() if first.get(k) != flags.get(k))
        assert not differ, f"deployment.md, {layout}: the command line at {where} differs in {differ}"


@pytest.mark.parametrize(
    ("right", "wrong", "said"),
    [
        ("--job-id", "--jobid", "unrecognized arguments: --jobid"),
        ("--spares", "--spare", "unrecognized arguments: --spare"),  # argparse's abbreviation, refused
        ("--join", "--joins", "unrecognized arguments: --joins"),
    ],
)
def test_a_misspelled_flag_in_the_page_fails_the_check(right: str, wrong: str, said: str) -> None:
    page = PAGE.replace(f"{right},", f"{wrong},").replace(f"{right} ", f"{wrong} ").replace(f"{right}]", f"{wrong}]")
    assert page != PAGE
    bad = [c for c in commands(page) if wrong in c.argv]
    assert bad
    for c in bad:
        with pytest.raises(UsageError, match=said):
            check(c.argv)


def test_the_manifests_are_kubernetes_objects_in_the_documented_layout() -> None:
    docs = manifests(PAGE)
    assert docs, "deployment.md has no YAML manifests"
    for block, doc in docs:
        where = f"deployment.md:{block.line}"
        assert {"apiVersion", "kind", "metadata", "spec"} <= doc.keys(), where
        assert doc["metadata"].get("name") or doc["metadata"].get("generateName"), where
    services = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Service"}
    sets = [d for _, d in docs if d["kind"] == "StatefulSet"]
    pods = [d for _, d in docs if d["kind"] == "Pod"]
    assert len(sets) == 1 and sets[0]["spec"]["replicas"] == 3, "etcd is a StatefulSet of three"
    etcd = sets[0]
    service = services.get(etcd["spec"]["serviceName"])
    assert service is not None and service["spec"].get("clusterIP") == "None", "etcd's service is headless"
    assert service["spec"]["selector"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()
    members = {f"{etcd['metadata']['name']}-{i}.{service['metadata']['name']}:2379" for i in range(3)}
    assert pods
    for pod in pods:
        assert pod["spec"]["restartPolicy"] == "Never"
        mounts = {m["mountPath"] for c in _containers(pod) for m in c.get("volumeMounts", [])}
        assert {"/dev/shm", "/shared"} <= mounts
        for argv in yaml_commands(pod, "pod"):
            args, _ = check(argv)
            assert set(args.rdzv.removeprefix("etcd://").split(",")) == members, "--rdzv names the etcd members"
            assert args.run_dir.is_relative_to("/shared")


def test_the_shell_scripts_are_valid_bash() -> None:
    scripts = [b for b in blocks(PAGE) if b.lang == "bash"]
    assert scripts
    for b in scripts:
        done = subprocess.run(["bash", "-n"], input=b.text, capture_output=True, text=True, timeout=10)
        assert done.returncode == 0, f"deployment.md:{b.line}: {done.stderr.strip()}"
