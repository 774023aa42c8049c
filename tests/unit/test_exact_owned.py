"""Which directories a whole-box snapshot owns at / (box/exact.py ``owned``, issue 47): chosen from what its
manifest records, minus what this box's own system, users, disks and host-path rules need merged."""

from __future__ import annotations

from ogrefs.box import exact
from ogrefs.box.hostpaths import DEFAULT_RULES, Rule
from tests.system.test_run_exact import _Catalog

HOME = "a home directory: this box's users keep theirs (only the snapshot's directories in it are exact)"
RULES = [Rule(k, p) for k, p in DEFAULT_RULES] + [Rule("host", "/opt/provider-agent")]


def _manifest(git=(), runs=(), envs=()) -> dict:
    return {"environment": {"git": [{"path": p} for p in git],
                            "checkpoints": {"runs": [{"dir": d} for d in runs]},
                            "python_envs": [{"path": p, "kind": "venv"} for p in envs]}}


def _snapshot() -> _Catalog:
    return _Catalog({
        "opt": {"project": {"ckpts": {"ckpt_001000.pt": None}, ".venv": {}}, "venv": {}, "provider-agent": {},
                "conda": {}},
        "home": {"alice": {"proj": {"runs": {}}, ".bashrc": None}},
        "root": {"notes.txt": None, ".cache": {"hub": {}}},
        "usr": {"local": {"lib": {"python3.11": {}}}},
        "workspace": {"data": {}}, "srv": {}, "tmp": {"run": {}}, "data": {"home": {"bob": {}}},
        "mnt": {"disk": {"run": {}}}, "scratch": {}, "link": None,
    })


def test_the_manifests_work_trees_runs_and_environments_are_exact_outermost_only():
    got = exact.owned(_manifest(git=["/opt/project"], runs=["/opt/project/ckpts", "/home/alice/proj/runs"],
                                envs=["/opt/venv", "/opt/project/.venv", "/opt/conda"]), _snapshot(), RULES)
    # /opt/project/ckpts and .venv lie in /opt/project: one directory said, one mask entry
    assert got.exact == ["/home/alice/proj/runs", "/opt/conda", "/opt/project", "/opt/venv", "/workspace"]
    assert got.left == [("/opt", "shared with this box's own directories")]  # /opt/venv's "project"


def test_an_in_project_environment_makes_its_project_exact_but_not_where_this_boxs_ogrefs_runs_from():
    """The lab's box A records no git tree and no checkpoint it can read, only /opt/project/.venv: its
    project is /opt/project. Its /opt/ogrefs/venv is where this box's own ogrefs runs from: left merged."""
    snap = _Catalog({"opt": {"project": {".venv": {}, "checkpoints": {}}, "ogrefs": {"venv": {}, "src": {}},
                             "app": {"venv": {}}}})
    got = exact.owned(_manifest(envs=["/opt/ogrefs/venv", "/opt/project/.venv", "/opt/app/venv", "/usr"]), snap,
                      RULES, runs_from=["/opt/ogrefs/venv", "/opt/ogrefs/src"])
    assert got.exact == ["/opt/app", "/opt/project"]
    assert dict(got.left) == {
        "/opt/ogrefs": "this box's ogrefs runs from /opt/ogrefs/src",
        "/opt/ogrefs/venv": "this box's ogrefs runs from /opt/ogrefs/venv",
        "/usr": "a system directory: this box's own system needs its entries"}


def test_a_conventional_data_root_counts_only_where_the_snapshot_has_it():
    bare = _Catalog({"opt": {"project": {}}})
    assert exact.owned(_manifest(git=["/opt/project"]), bare, RULES).exact == ["/opt/project"]
    assert exact.owned({}, _snapshot(), RULES).exact == ["/workspace"]  # no environment recorded at all


def test_system_shared_home_and_host_kept_directories_stay_merged_and_say_why():
    named = ["/", "/usr/local/lib/python3.11", "/opt", "/srv", "/home", "/home/alice", "/root", "/tmp/run",
             "/opt/provider-agent", "/data", "/mnt/disk/run", "/scratch", "/link", "/nowhere"]
    got = exact.owned(_manifest(git=named), _snapshot(), RULES, homes=["/home/alice", "/data/home/bob", "/"],
                      mounts=["/", "/scratch"])
    why = dict(got.left)
    assert got.exact == ["/mnt/disk/run", "/workspace"], got  # inside /mnt: the snapshot's own run is exact
    assert why == {
        "/": "the whole box",
        "/usr/local/lib/python3.11": "a system directory: this box's own system needs its entries",
        "/opt": "shared with this box's own directories",
        "/srv": "shared with this box's own directories",
        "/home": "shared with this box's own directories",
        "/home/alice": HOME, "/root": HOME,
        "/tmp/run": "never overlaid: this box's own",
        "/opt/provider-agent": "kept from this box by a host-path rule",
        "/data": "holds this box's home directory /data/home/bob",
        "/scratch": "a file system of this box is mounted there",
        "/link": "not a directory in the snapshot",
        "/nowhere": "not a directory in the snapshot",
    }


def test_a_directory_inside_a_home_is_exact_but_the_home_of_a_user_of_the_snapshot_is_not():
    got = exact.owned(_manifest(git=["/home/alice", "/home/alice/proj"], envs=["/root/.cache/hub"]), _snapshot(),
                      RULES, homes=["/root"])
    assert got.exact == ["/home/alice/proj", "/root/.cache/hub", "/workspace"]
    assert [p for p, _ in got.left] == ["/home/alice"]


def test_a_host_rule_below_an_owned_directory_keeps_that_entry_of_this_box(tmp_path):
    """Owned, then masked by the mask's own rules: this box's login key under an owned directory still shows."""
    (tmp_path / "home/alice/proj/.ssh").mkdir(parents=True)
    (tmp_path / "home/alice/proj/.ssh/authorized_keys").write_text("this box\n")
    (tmp_path / "home/alice/proj/ckpt_005000.pt").write_text("this box\n")
    rules = [Rule("merge", "/home/*/proj/.ssh/authorized_keys")]
    snap = _Catalog({"home": {"alice": {"proj": {"ckpt_001000.pt": None}}}})
    own = exact.owned(_manifest(git=["/home/alice/proj"]), snap, rules)
    assert own.exact == ["/home/alice/proj"]
    got = {(e.path, e.kind) for e in exact.plan(snap, rules, own.exact, str(tmp_path))}
    assert got == {("/home/alice/proj", "dir"), ("/home/alice/proj/ckpt_005000.pt", "whiteout"),
                   ("/home/alice/proj/.ssh", "dir")}
