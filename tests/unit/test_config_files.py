"""A configuration read from several files: tables merged key by key, a later scalar over
an earlier one, [[games]] and [[channels]] concatenated, every problem naming its file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capsvc.config import ConfigError, config_paths, load_settings

SHA = "0" * 64
SHA2 = "1" * 64


def channel(cid: str, digest: str = SHA, game: str = "g") -> str:
    return (f'[[channels]]\nid = "{cid}"\ntoken_sha256 = "{digest}"\ngames = ["{game}"]\n'
            'scopes = ["sell"]\n')


def game(gid: str = "g") -> str:
    return f'[[games]]\nid = "{gid}"\npreset = "lnm-keno"\n'


def files(tmp_path: Path, **texts: str) -> list[Path]:
    out = []
    for name, text in texts.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        out.append(path)
    return out


def problems(paths: list[Path]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_settings(paths)
    return e.value.problems


def test_tables_merge_key_by_key_and_a_later_scalar_wins(tmp_path: Path) -> None:
    """A [redis] table of one file (a Secret) and the [redis] keys of another (a ConfigMap)
    make one table; a key set twice takes the later file's value."""
    paths = files(tmp_path,
                  secret='[redis]\nurl = "redis://:pw@redis:6379/0"\n',
                  config='redis.timeout = "300ms"\n[server]\nport = 9000\nworkers = 2\n'
                         + game(),
                  local='[server]\nport = 9100\n[redis]\ntimeout = "400ms"\n')
    s = load_settings(paths)
    assert (s.redis_url, s.redis_timeout_ms) == ("redis://:pw@redis:6379/0", 400)
    assert (s.port, s.workers) == (9100, 2)
    assert s.source == ", ".join(map(str, paths))
    assert load_settings(paths[:2]).redis_timeout_ms == 300


def test_a_later_list_value_replaces_an_earlier_one(tmp_path: Path) -> None:
    paths = files(tmp_path, a='[audit]\nsources = ["/a", "/b"]\n' + game(),
                  b='[audit]\nsources = ["/c"]\n')
    assert load_settings(paths).audit_sources == ("/c",)


def test_games_and_channels_are_concatenated_in_file_order(tmp_path: Path) -> None:
    paths = files(tmp_path, games=game("g") + game("h"),
                  channels=channel("c1") + channel("c2", SHA2, "h"))
    s = load_settings(paths)
    assert list(s.games) == ["g", "h"]
    assert [c.id for c in s.channels] == ["c1", "c2"]


def test_a_game_or_channel_id_in_two_files_names_both(tmp_path: Path) -> None:
    paths = files(tmp_path, a=game("g") + channel("c"),
                  b=game("h") + game("g") + channel("c", SHA2))
    a, b = paths
    assert sorted(problems(paths)) == sorted([
        f"{b}: games[1].id: duplicate game id 'g' (also games[0] of {a})",
        f"{b}: channels[0].id: duplicate channel id 'c' (also channels[0] of {a})",
    ])


def test_each_problem_names_its_file_and_its_place_there(tmp_path: Path) -> None:
    """Unknown keys are found file by file, with the key they most resemble; a value's
    problem names the file that set it (the last one), an entry's its index in its file."""
    paths = files(tmp_path, a='[redis]\nurll = "redis://x"\n[server]\nport = "x"\n' + game(),
                  b='[server]\nport = 8081\nhots = "h"\n' + game("h") + "stakes = [0]\n",
                  c='wat = 1\n[janitor]\ninterval = "soon"\n')
    a, b, c = paths
    assert sorted(problems(paths)) == sorted([
        f"{a}: redis.urll: unknown field (did you mean 'url'?)",
        f"{b}: server.hots: unknown field (did you mean 'host'?)",
        f"{b}: games[0].stakes[0]: must be between 1 and 1000000000000, got 0",
        f'{c}: janitor.interval: expected a duration like "250ms", "5m" or "24h", '
        "got 'soon'",
        f"{c}: wat: unknown section",
    ])


def test_a_table_of_the_wrong_type_names_its_file(tmp_path: Path) -> None:
    paths = files(tmp_path, a=game() + "[server]\nport = 1\n", b='server = 5\ngames = "x"\n')
    b = paths[1]
    assert sorted(problems(paths)) == sorted([f"{b}: server: expected a [server] table",
                                              f"{b}: games: expected [[games]] entries"])


def test_a_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    (config,) = files(tmp_path, a=game())
    with pytest.raises(ConfigError, match=r"missing\.toml: cannot read"):
        load_settings([config, tmp_path / "missing.toml"])
    (tmp_path / "bad.toml").write_text("[server\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load_settings([config, tmp_path / "bad.toml"])


def test_each_file_s_channels_file_is_beside_it(tmp_path: Path) -> None:
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "channels.toml").write_text(channel("c", game="g"))
    paths = files(tmp_path, a='channels_file = "secret/channels.toml"\n' + game(),
                  b='[redis]\nurl = "redis://r:6379/0"\n')
    assert [c.id for c in load_settings(paths).channels] == ["c"]
    (tmp_path / "secret" / "channels.toml").write_text(channel("c", game="nope"))
    assert problems(paths) == [f"{tmp_path / 'secret' / 'channels.toml'}: channels[0].games[0]: "
                               "no game 'nope' is defined"]


def test_the_environment_still_overrides_the_files(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    paths = files(tmp_path, a=game(), b='[redis]\nurl = "redis://file:6379/0"\n')
    monkeypatch.setenv("CAPSVC_REDIS_URL", "redis://env:6379/0")
    assert load_settings(paths).redis_url == "redis://env:6379/0"
    monkeypatch.setenv("CAPSVC_REDIS_URL", "http://nope")
    assert problems(paths)[0].startswith("CAPSVC_REDIS_URL: redis.url: expected redis://")


def test_capsvc_config_lists_paths_separated_like_path(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = files(tmp_path, a=game(), b="[server]\nport = 9001\n")
    monkeypatch.setenv("CAPSVC_CONFIG", f"{a}{os.pathsep}{os.pathsep}{b}")
    assert config_paths() == [a, b]
    assert load_settings().port == 9001
    assert config_paths(str(a)) == [a]
    assert config_paths([a, str(b)]) == [a, b]


def test_one_file_keeps_its_problems_without_a_prefix(tmp_path: Path) -> None:
    (config,) = files(tmp_path, a='[redis]\nurll = "x"\n' + game())
    assert problems([config]) == ["redis.urll: unknown field (did you mean 'url'?)"]
