"""The auth core without HTTP: scopes, JWT verification and its cache, JWKS loading and refresh,
signed read links, and append quotas. Clocks are injected (or trio's autojump clock), so nothing
here sleeps for real."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import ssl
import stat
import time
from functools import cache, partial
from pathlib import Path

import jwt
import pytest
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from streamkeep.auth import (
    AuthError,
    Grants,
    JwksKeys,
    JwksSource,
    LinkKeys,
    Principal,
    Quotas,
    TokenVerifier,
    UnknownKey,
    forbidden,
    link_url,
    rate_limited,
    sign_link,
    unauthorized,
    verify_link,
)
from streamkeep.auth import jwks as jwks_module
from streamkeep.auth.scopes import MAX_ENTRIES, MAX_GLOB_CHARS

NOW = 1_800_000_000.0
SECRET = "a-shared-secret-of-at-least-32-bytes!!"


class Clock:
    """A settable clock for the code under test."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def reason_of(call, *args, **kwargs) -> str:
    with pytest.raises(AuthError) as caught:
        call(*args, **kwargs)
    assert caught.value.status == 401
    return caught.value.reason


# ---- scopes ---------------------------------------------------------------------------------


def test_scope_string_keeps_known_entries_and_skips_the_rest():
    grants = Grants.from_claim(
        "openid profile read:logs/** email append:metrics/* foo:bar write:team/** read:"
    )
    assert grants.read == {"logs/**"}
    assert grants.append == {"metrics/*"}
    assert grants.write == {"team/**"}
    assert not grants.admin
    assert grants.to_list() == ["write:team/**", "append:metrics/*", "read:logs/**"]


@pytest.mark.parametrize(
    ("claim", "action", "name", "allowed"),
    [
        ("read:logs/**", "read", "logs/a/b", True),
        ("read:logs/**", "read", "other/a", False),
        ("read:logs/**", "append", "logs/a", False),
        ("read:logs/**", "write", "logs/a", False),
        ("append:metrics/*", "append", "metrics/cpu", True),
        ("append:metrics/*", "append", "metrics/cpu/x", False),  # `*` is one segment
        ("append:metrics/*", "read", "metrics/cpu", False),  # append does not imply read
        ("append:metrics/*", "write", "metrics/cpu", False),  # nor create/delete
        ("write:team/**", "read", "team/a", True),  # write implies read
        ("write:team/**", "append", "team/a/b", True),  # and append
        ("write:team/**", "write", "team/a", True),
        ("write:team/**", "admin", "team/a", False),
        ("read:a/*-prod", "read", "a/eu-prod", True),
        ("read:a/*-prod", "read", "a/eu-dev", False),
        ("read:exact/name", "read", "exact/name", True),
        ("read:exact/name", "read", "exact/name2", False),
        ("admin", "read", "any/thing", True),
        ("admin", "append", "any/thing", True),
        ("admin", "write", "any/thing", True),
        ("admin", "admin", "", True),
        ("read:** append:** write:**", "admin", "", False),
        ("", "read", "a", False),
    ],
)
def test_allows(claim, action, name, allowed):
    assert Grants.from_claim(claim).allows(action, name) is allowed


def test_array_claims_and_junk():
    grants = Grants.from_claim(["read:a/*", "append:b", 42, None, {"x": 1}, "admin-ish", "ADMIN", "read=a/b"])
    assert grants.allows("read", "a/x")
    assert grants.allows("append", "b")
    assert not grants.admin
    # The exact-name form is for stored grants only: a token cannot use it.
    assert not grants.allows("read", "a/b/c") and not grants.read_names
    assert Grants.from_claim(("write:x",)).allows("write", "x")
    for claim in (None, 7, {"read": "a"}, "", []):
        assert Grants.from_claim(claim).is_empty
    assert Grants.from_claim(["admin"]) == Grants.ALL


def test_hostile_sizes_are_capped():
    long_glob = "a/" + "x" * (MAX_GLOB_CHARS - 2)
    assert Grants.from_claim(f"read:{long_glob}").allows("read", long_glob)
    assert Grants.from_claim(f"read:{long_glob}x").is_empty
    filler = ["openid"] * (MAX_ENTRIES - 1)
    assert Grants.from_claim([*filler, "read:last"]).allows("read", "last")
    assert Grants.from_claim([*filler, "openid", "read:late"]).is_empty
    assert Grants.from_claim(" ".join([*filler, "read:last"])).allows("read", "last")
    assert Grants.from_claim(" ".join([*filler, "openid", "read:late"])).is_empty
    started = time.perf_counter()
    assert Grants.from_claim("x " * 500_000 + "admin").is_empty
    assert time.perf_counter() - started < 0.5


def test_grants_are_canonical_hashable_and_round_trip():
    a = Grants.from_claim("read:b read:a write:c read:a")
    b = Grants.from_claim(["write:c", "read:a", "read:b"])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert Grants.from_list(a.to_list()) == a
    assert Grants.from_claim("admin read:x").to_list() == ["admin"]
    assert Grants.from_list(["admin"]) is Grants.ALL
    exact = Grants.exact_read("a/b*c")
    assert exact.to_list() == ["read=a/b*c"]
    assert Grants.from_list(exact.to_list()) == exact
    assert Grants.from_list(["read:x", "delete:y", "read="]).to_list() == ["read:x"]
    assert Grants.NONE.is_empty and not Grants.ALL.is_empty
    with pytest.raises(TypeError):
        Grants.from_list("read:x")
    with pytest.raises(ValueError, match="unknown action"):
        Grants.NONE.allows("delete", "x")
    with pytest.raises(ValueError, match="unknown action"):
        Grants.ALL.allows("delete", "x")


def test_exact_read_takes_the_name_literally():
    grants = Grants.exact_read("logs/*")
    assert grants.allows("read", "logs/*")
    assert not grants.allows("read", "logs/a")
    assert not grants.allows("append", "logs/*")
    assert not grants.allows("write", "logs/*")


# ---- errors ---------------------------------------------------------------------------------


def test_errors():
    error = unauthorized("expired", "get a new token")
    assert (error.status, error.reason, error.message, error.retry_after) == (
        401,
        "expired",
        "get a new token",
        None,
    )
    assert (forbidden("no").status, forbidden("no").reason) == (403, "insufficient_scope")
    limited = rate_limited(2.5, "slow down")
    assert (limited.status, limited.reason, limited.retry_after) == (429, "quota", 2.5)
    with pytest.raises(ValueError, match="unknown auth refusal reason"):
        unauthorized("nope", "x")


# ---- HS256 tokens ---------------------------------------------------------------------------


def hs(claims: dict, secret: str = SECRET, headers: dict | None = None) -> str:
    return jwt.encode(claims, secret, algorithm="HS256", headers=headers)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forge_hs256(claims: dict, key: bytes, header: dict | None = None) -> str:
    """An HS256 token made by hand: PyJWT refuses to sign with a PEM, an attacker does not."""
    segments = [
        b64(json.dumps(part).encode()) for part in ({"alg": "HS256", "typ": "JWT", **(header or {})}, claims)
    ]
    signing_input = ".".join(segments)
    return f"{signing_input}.{b64(hmac.new(key, signing_input.encode(), hashlib.sha256).digest())}"


def hs_verifier(clock: Clock | None = None, **options) -> TokenVerifier:
    settings = {"secret": SECRET, "keys": None, "issuer": None, "audience": None, "clock": clock or Clock()}
    return TokenVerifier(**(settings | options))


def test_hs256_valid_token():
    verifier = hs_verifier()
    principal = verifier.verify(hs({"sub": "alice", "exp": NOW + 60, "scope": "read:a/** openid"}))
    assert principal == Principal(
        subject="alice", grants=Grants.from_claim("read:a/**"), expires_at=NOW + 60, via="bearer"
    )
    assert verifier.verify(hs({"sub": "bob"}), via="query").via == "query"
    assert verifier.verify(hs({"sub": "bob"})).expires_at is None  # exp is not required
    assert verifier.verify(hs({})).subject is None
    with pytest.raises(ValueError):
        verifier.verify(hs({}), via="carrier-pigeon")


def test_hs256_times_with_leeway():
    verifier = hs_verifier(cache_size=0)
    assert reason_of(verifier.verify, hs({"exp": NOW - 30})) == "expired"
    assert verifier.verify(hs({"exp": NOW - 29})).expires_at == NOW - 29
    assert reason_of(verifier.verify, hs({"nbf": NOW + 31})) == "not_yet_valid"
    verifier.verify(hs({"nbf": NOW + 29}))
    assert reason_of(verifier.verify, hs({"iat": NOW + 31})) == "not_yet_valid"
    strict = hs_verifier(leeway=0, cache_size=0)
    assert reason_of(strict.verify, hs({"exp": NOW})) == "expired"
    strict.verify(hs({"exp": NOW + 1}))


@pytest.mark.parametrize("bad", ["1800000060", True, None, [1], float("nan"), float("inf"), 10**400])
def test_dates_must_be_finite_numbers(bad):
    verifier = hs_verifier()
    if bad is None:
        assert verifier.verify(hs({"exp": bad})).expires_at is None  # null is as good as absent
        return
    # Signed with the right secret by hand: only the date can be wrong.
    token = forge_hs256({"exp": bad}, SECRET.encode())
    assert reason_of(verifier.verify, token) == "malformed_token"


def test_hs256_refusals():
    verifier = hs_verifier()
    assert (
        reason_of(verifier.verify, hs({"sub": "x"}, secret="another-secret-of-32-bytes-or-more!!"))
        == "bad_signature"
    )
    assert reason_of(verifier.verify, "") == "missing_token"
    assert reason_of(verifier.verify, "not-a-jwt") == "malformed_token"
    assert reason_of(verifier.verify, "a.b.c") == "malformed_token"
    assert reason_of(verifier.verify, hs({"sub": "x"}) + "x" * 20_000) == "malformed_token"
    assert reason_of(verifier.verify, hs({"sub": 5})) == "malformed_token"
    tampered = hs({"sub": "x", "scope": "read:a"}).split(".")
    tampered[1] = b64(json.dumps({"sub": "x", "scope": "admin"}).encode())
    assert reason_of(verifier.verify, ".".join(tampered)) == "bad_signature"
    assert verifier.cache_info()["size"] == 0  # failures are never cached


def test_none_and_other_algorithms_are_refused():
    verifier = hs_verifier()
    unsigned = jwt.encode({"sub": "x", "scope": "admin"}, None, algorithm="none")
    assert reason_of(verifier.verify, unsigned) == "unsupported_algorithm"
    assert reason_of(verifier.verify, unsigned + "c2ln") == "unsupported_algorithm"
    hs512 = jwt.encode({"sub": "x"}, SECRET + SECRET, algorithm="HS512")
    assert reason_of(verifier.verify, hs512) == "unsupported_algorithm"
    assert reason_of(verifier.verify, jwt.encode({}, rsa_key(), algorithm="RS256")) == "unsupported_algorithm"


def test_audience_and_issuer():
    verifier = hs_verifier(audience="streamkeep", issuer="https://issuer.example")
    good = {"aud": "streamkeep", "iss": "https://issuer.example"}
    assert verifier.verify(hs(good)).subject is None
    assert verifier.verify(hs(good | {"aud": ["other", "streamkeep"]})).subject is None
    assert reason_of(verifier.verify, hs(good | {"aud": "other"})) == "bad_audience"
    assert reason_of(verifier.verify, hs({"iss": good["iss"]})) == "bad_audience"
    assert reason_of(verifier.verify, hs(good | {"iss": "https://evil.example"})) == "bad_issuer"
    assert reason_of(verifier.verify, hs({"aud": "streamkeep"})) == "bad_issuer"
    # Unconfigured (or empty, as the config file spells it): a token's aud is not held against it.
    assert hs_verifier(audience="", issuer="").verify(hs({"aud": "whatever", "iss": "x"})).subject is None


def test_scope_claim_is_configurable():
    verifier = hs_verifier(scope_claim="scp")
    grants = verifier.verify(hs({"scp": ["read:a", "append:b"], "scope": "admin"})).grants
    assert grants.allows("read", "a") and grants.allows("append", "b") and not grants.admin
    permissions = hs_verifier(scope_claim="permissions").verify(hs({"permissions": "write:x/**"})).grants
    assert permissions.allows("write", "x/y")


def test_verifier_needs_a_secret_or_keys():
    assert hs_verifier().has_secret and not hs_verifier().has_keys
    both = hs_verifier(keys=JwksKeys())
    assert both.has_secret and both.has_keys
    with pytest.raises(ValueError):
        TokenVerifier(secret="", keys=None, issuer=None, audience=None)
    with pytest.raises(ValueError):
        TokenVerifier(secret=SECRET, keys=None, issuer=None, audience=None, scope_claim="")


# ---- JWKS tokens ----------------------------------------------------------------------------


@cache
def rsa_key(n: int = 0) -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@cache
def ec_key(n: int = 0) -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


@cache
def ed_key(n: int = 0) -> ed25519.Ed25519PrivateKey:
    return ed25519.Ed25519PrivateKey.generate()


def public_jwk(private, kid: str | None, **extra) -> dict:
    public = private.public_key()
    if isinstance(public, rsa.RSAPublicKey):
        jwk = RSAAlgorithm.to_jwk(public, as_dict=True)
    elif isinstance(public, ec.EllipticCurvePublicKey):
        jwk = ECAlgorithm.to_jwk(public, as_dict=True)
    else:
        jwk = OKPAlgorithm.to_jwk(public, as_dict=True)
    if kid is not None:
        jwk["kid"] = kid
    return jwk | extra


def jwks_doc(*jwks: dict) -> bytes:
    return json.dumps({"keys": list(jwks)}).encode()


def signed(private, alg: str, kid: str | None, claims: dict) -> str:
    return jwt.encode(claims, private, algorithm=alg, headers=None if kid is None else {"kid": kid})


def key_verifier(keys: JwksKeys, clock: Clock | None = None, **options) -> TokenVerifier:
    settings = {"secret": None, "keys": keys, "issuer": None, "audience": None, "clock": clock or Clock()}
    return TokenVerifier(**(settings | options))


def loaded_keys(*jwks: dict) -> JwksKeys:
    keys = JwksKeys()
    keys.load(jwks_doc(*jwks))
    return keys


@pytest.mark.parametrize(("alg", "make"), [("RS256", rsa_key), ("ES256", ec_key), ("EdDSA", ed_key)])
def test_jwks_algorithms(alg, make):
    keys = loaded_keys(public_jwk(make(), "k1"), public_jwk(make(1), "k2", alg=alg, use="sig"))
    verifier = key_verifier(keys)
    for kid, private in (("k1", make()), ("k2", make(1))):
        principal = verifier.verify(signed(private, alg, kid, {"sub": kid, "scope": "read:x"}))
        assert principal.subject == kid and principal.grants.allows("read", "x")
    # Signed by the other key of the set, claiming this kid.
    assert reason_of(verifier.verify, signed(make(1), alg, "k1", {})) == "bad_signature"
    with pytest.raises(UnknownKey) as caught:
        verifier.verify(signed(make(), alg, "k3", {}))
    assert (caught.value.kid, caught.value.status, caught.value.reason) == ("k3", 401, "unknown_key")
    # Without a kid, only a lone key is unambiguous.
    with pytest.raises(UnknownKey) as caught:
        verifier.verify(signed(make(), alg, None, {}))
    assert caught.value.kid is None
    assert (
        key_verifier(loaded_keys(public_jwk(make(), None)))
        .verify(signed(make(), alg, None, {"sub": "s"}))
        .subject
        == "s"
    )


def test_alg_confusion_is_refused():
    """The classic attack: an HS256 token whose HMAC key is the server's public RSA key."""
    pem = (
        rsa_key()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    keys = loaded_keys(public_jwk(rsa_key(), "rsa"))
    forged = forge_hs256({"sub": "mallory", "scope": "admin"}, pem, {"kid": "rsa"})
    assert reason_of(key_verifier(keys).verify, forged) == "unsupported_algorithm"
    # With a shared secret too, HS256 is checked against that secret only, never a JWKS key.
    assert reason_of(key_verifier(keys, secret=SECRET).verify, forged) == "bad_signature"
    forged_jwk = forge_hs256(
        {"scope": "admin"}, json.dumps(public_jwk(rsa_key(), "rsa")).encode(), {"kid": "rsa"}
    )
    assert reason_of(key_verifier(keys, secret=SECRET).verify, forged_jwk) == "bad_signature"
    # A known key with another alg than the token's: refused outright, no refresh.
    mixed = key_verifier(loaded_keys(public_jwk(rsa_key(), "rsa"), public_jwk(ec_key(), "ec")))
    assert reason_of(mixed.verify, signed(ec_key(), "ES256", "rsa", {})) == "unsupported_algorithm"
    assert reason_of(mixed.verify, signed(rsa_key(), "RS256", "ec", {})) == "unsupported_algorithm"


def test_both_secret_and_keys():
    keys = loaded_keys(public_jwk(ec_key(), "ec"))
    verifier = key_verifier(keys, secret=SECRET)
    assert verifier.verify(hs({"sub": "h"})).subject == "h"
    assert verifier.verify(signed(ec_key(), "ES256", "ec", {"sub": "e"})).subject == "e"


def test_jwks_parsing_skips_what_it_cannot_use():
    private_jwk = json.loads(RSAAlgorithm.to_jwk(rsa_key(1)))  # a private key: its public part is used
    private_jwk["kid"] = "leaked"
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    keys = JwksKeys()
    removed = keys.load(
        jwks_doc(
            public_jwk(rsa_key(), "good"),
            public_jwk(rsa_key(), "enc", use="enc"),
            public_jwk(rsa_key(), "ops", key_ops=["encrypt"]),
            public_jwk(rsa_key(), "rs512", alg="RS512"),
            public_jwk(rsa_key(), "hs", alg="HS256"),
            {"kty": "oct", "k": "c2VjcmV0", "kid": "oct"},
            public_jwk(ec.generate_private_key(ec.SECP384R1()), "p384"),
            public_jwk(ec_key(), "lying", alg="EdDSA"),
            public_jwk(small, "small"),
            public_jwk(ec_key(), "good"),  # a duplicate kid
            {"kty": "RSA", "kid": "broken", "n": "!!", "e": "AQAB"},
            "not an object",
            private_jwk,
        )
    )
    assert removed == set()
    assert keys.kids == ["good", "leaked"]
    assert len(keys.skipped) == 11
    assert any("enc" in line for line in keys.skipped) and any("1024 bits" in line for line in keys.skipped)
    assert isinstance(keys.key_for("leaked", "RS256"), rsa.RSAPublicKey)
    assert key_verifier(keys).verify(signed(rsa_key(1), "RS256", "leaked", {"sub": "x"})).subject == "x"


def test_jwks_load_failures_keep_the_keys():
    keys = loaded_keys(public_jwk(ec_key(), "ec"))
    for document in (
        b"not json",
        b"[]",
        b'{"keys": "x"}',
        b'{"keys": []}',
        jwks_doc({"kty": "oct", "k": "eA"}),
    ):
        with pytest.raises(ValueError):
            keys.load(document)
        assert keys.kids == ["ec"]
    # Removed kids, and a kid whose key changed, are reported.
    keys.load(jwks_doc(public_jwk(ec_key(), "ec"), public_jwk(ed_key(), "ed")))
    assert keys.load(jwks_doc(public_jwk(ec_key(1), "ec"), public_jwk(rsa_key(), "rsa"))) == {"ec", "ed"}


# ---- the verification cache -----------------------------------------------------------------


def test_cache_hits_and_via():
    verifier = hs_verifier()
    token = hs({"sub": "alice", "exp": NOW + 60})
    first = verifier.verify(token)
    assert verifier.verify(token) is first
    assert verifier.cache_info() == {"hits": 1, "misses": 1, "size": 1}
    assert verifier.verify(token, via="query") == Principal("alice", Grants.NONE, NOW + 60, "query")
    verifier.clear_cache()
    assert verifier.cache_info()["size"] == 0


def test_cached_token_expires_like_an_uncached_one():
    clock = Clock()
    cached = hs_verifier(clock)
    uncached = hs_verifier(clock, cache_size=0)
    token = hs({"sub": "alice", "exp": NOW + 60})
    cached.verify(token)
    clock.now = NOW + 60 + 30 - 0.001
    assert cached.verify(token).subject == uncached.verify(token).subject == "alice"
    assert cached.cache_info()["hits"] == 1
    clock.now = NOW + 60 + 30
    assert reason_of(cached.verify, token) == reason_of(uncached.verify, token) == "expired"
    assert cached.cache_info()["size"] == 0
    # A clock stepping back before nbf: cached or not, not valid yet.
    clock.now = NOW
    early = hs({"nbf": NOW + 10})
    cached.verify(early)
    clock.now = NOW - 100
    assert reason_of(cached.verify, early) == reason_of(uncached.verify, early) == "not_yet_valid"


def test_cache_is_bounded_oldest_first():
    verifier = hs_verifier(cache_size=3)
    tokens = [hs({"sub": str(n)}) for n in range(5)]
    for token in tokens:
        verifier.verify(token)
    assert verifier.cache_info() == {"hits": 0, "misses": 5, "size": 3}
    verifier.verify(tokens[4])
    assert verifier.cache_info()["hits"] == 1
    verifier.verify(tokens[0])  # evicted: checked again
    assert verifier.cache_info()["misses"] == 6


def test_forget_kids_drops_tokens_of_removed_keys():
    keys = loaded_keys(public_jwk(ec_key(), "A"), public_jwk(ec_key(1), "B"))
    verifier = key_verifier(keys, secret=SECRET)
    token_a = signed(ec_key(), "ES256", "A", {"sub": "a"})
    verifier.verify(token_a)
    verifier.verify(signed(ec_key(1), "ES256", "B", {"sub": "b"}))
    verifier.verify(hs({"sub": "h"}, headers={"kid": "A"}))  # HS256: the kid means nothing to the JWKS
    assert verifier.forget_kids(set()) == 0
    assert verifier.forget_kids({"A"}) == 1
    assert verifier.cache_info()["size"] == 2
    keys.load(jwks_doc(public_jwk(ec_key(1), "B")))
    with pytest.raises(UnknownKey):
        verifier.verify(token_a)
    # A token without a kid was checked with the lone key of the time: any removal drops it.
    lone = loaded_keys(public_jwk(ed_key(), "only"))
    lone_verifier = key_verifier(lone)
    lone_verifier.verify(signed(ed_key(), "EdDSA", None, {}))
    assert lone_verifier.forget_kids({"only"}) == 1


# ---- JwksSource -----------------------------------------------------------------------------


class MemoryFetch:
    """A fetch function over a document held in memory, that counts calls and can fail or hang."""

    def __init__(self, document: bytes) -> None:
        self.document = document
        self.calls = 0
        self.error: Exception | None = None
        self.gate: trio.Event | None = None

    async def __call__(self, location: str) -> bytes:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        await trio.lowlevel.checkpoint()
        if self.error is not None:
            raise self.error
        return self.document


async def test_file_source_refreshes_on_unknown_kid_rate_limited(tmp_path: Path):
    path = tmp_path / "jwks.json"
    path.write_bytes(jwks_doc(public_jwk(ec_key(), "k1")))
    fetches = []

    async def counting_fetch(location: str) -> bytes:
        fetches.append(location)
        return await jwks_module.fetch_location(location)  # the real one: a file read in a thread

    clock = Clock(0.0)
    keys = JwksKeys()
    verifier = key_verifier(keys)
    source = JwksSource(str(path), keys, fetch=counting_fetch, clock=clock, on_change=verifier.forget_kids)
    async with trio.open_nursery() as nursery:
        await nursery.start(source.run)
        with trio.fail_after(5):
            await source.loaded.wait()
        assert verifier.verify(signed(ec_key(), "ES256", "k1", {"sub": "one"})).subject == "one"
        path.write_bytes(jwks_doc(public_jwk(ec_key(), "k1"), public_jwk(ed_key(), "k2")))
        token = signed(ed_key(), "EdDSA", "k2", {"sub": "two"})
        with pytest.raises(UnknownKey) as caught:
            verifier.verify(token)
        assert not await source.refresh_for(caught.value.kid)  # within min_refresh_gap of the first load
        assert len(fetches) == 1
        clock.now = 11.0
        assert await source.refresh_for("k2")
        assert len(fetches) == 2
        assert verifier.verify(token).subject == "two"
        assert await source.refresh_for("k2")  # known now: no fetch needed
        assert not await source.refresh_for("k3")  # a random kid right after: no fetch
        assert len(fetches) == 2
        assert source.stats()["kids"] == ["k1", "k2"] and source.refreshes == 2
        nursery.cancel_scope.cancel()


async def test_concurrent_unknown_kids_share_one_fetch(autojump_clock):
    fetch = MemoryFetch(jwks_doc(public_jwk(ec_key(), "k1")))
    keys = JwksKeys()
    source = JwksSource("/jwks.json", keys, fetch=fetch, min_refresh_gap=10)
    results = []

    async def ask(kid):
        results.append(await source.refresh_for(kid))

    async with trio.open_nursery() as nursery:
        await nursery.start(source.run)
        await source.loaded.wait()
        await trio.sleep(11)
        fetch.document = jwks_doc(public_jwk(ec_key(), "k1"), public_jwk(ec_key(1), "k2"))
        fetch.gate = trio.Event()
        async with trio.open_nursery() as askers:
            for _ in range(5):
                askers.start_soon(ask, "k2")
            await trio.sleep(1)
            fetch.gate.set()
        assert results == [True] * 5
        assert fetch.calls == 2
        nursery.cancel_scope.cancel()


async def test_removed_kid_invalidates_cached_tokens(autojump_clock):
    fetch = MemoryFetch(jwks_doc(public_jwk(ec_key(), "A"), public_jwk(ec_key(1), "B")))
    keys = JwksKeys()
    verifier = key_verifier(keys)
    source = JwksSource("/jwks.json", keys, fetch=fetch, on_change=verifier.forget_kids)
    assert await source.load()
    token_a = signed(ec_key(), "ES256", "A", {"sub": "a"})
    verifier.verify(token_a)
    assert verifier.cache_info()["size"] == 1
    fetch.document = jwks_doc(public_jwk(ec_key(1), "B"))
    assert await source.load()
    assert verifier.cache_info()["size"] == 0
    with pytest.raises(UnknownKey):
        verifier.verify(token_a)


async def test_failing_fetch_keeps_keys_and_run_keeps_going(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="streamkeep.auth")
    fetch = MemoryFetch(jwks_doc(public_jwk(ec_key(), "k1")))
    fetch.error = OSError("connection refused")
    keys = JwksKeys()
    verifier = key_verifier(keys)
    source = JwksSource("/jwks.json", keys, fetch=fetch, refresh_interval=100)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        await nursery.start(source.run)  # started at once, although the issuer is down
        await trio.sleep(30)  # retried at 1, 2, 4, 8, 16 s
        assert not source.loaded.is_set()
        assert source.failures == 5 and source.last_error == "connection refused"
        fetch.error = None
        await trio.sleep(33)
        assert source.loaded.is_set() and source.last_error is None
        token = signed(ec_key(), "ES256", "k1", {"sub": "x"})
        assert verifier.verify(token).subject == "x"
        assert source.fetched_at == start + 31  # the sixth attempt
        fetch.error = ValueError("HTTP 503 from the JWKS URL")
        await trio.sleep_until(start + 31 + 100 + 1 + 2 + 4 + 0.5)  # the refresh, and retries after 1, 2, 4 s
        assert source.failures == 5 + 4
        verifier.clear_cache()
        assert verifier.verify(token).subject == "x"  # the old keys still serve
        assert source.stats()["last_error"] == "HTTP 503 from the JWKS URL"
        fetch.error = None
        await trio.sleep(8)
        assert source.last_error is None and source.refreshes == 2
        nursery.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one line per distinct cause, not one per attempt
    assert "connection refused" in warnings[0] and "refused until it loads" in warnings[0]
    assert "HTTP 503" in warnings[1] and "keeping the keys" in warnings[1]
    assert sum("loaded again" in r.getMessage() for r in caplog.records) == 2


async def test_refresh_wait_is_bounded_and_fetch_times_out(autojump_clock):
    fetch = MemoryFetch(jwks_doc(public_jwk(ec_key(), "k1")))
    keys = JwksKeys()
    source = JwksSource("/jwks.json", keys, fetch=fetch)
    assert not await source.refresh_for("k1")  # run is not running: no fetch from a request
    assert fetch.calls == 0
    fetch.gate = trio.Event()  # never set: the issuer hangs
    async with trio.open_nursery() as nursery:
        await nursery.start(source.run)
        started = trio.current_time()
        assert not await source.refresh_for("k1")  # joins the first load, gives up after 5 s
        assert trio.current_time() - started == pytest.approx(5)
        await trio.sleep(6)
        assert source.last_error == "no answer within 10 s"
        nursery.cancel_scope.cancel()


async def test_oversized_document_is_refused():
    fetch = MemoryFetch(b" " * (jwks_module.MAX_DOCUMENT_BYTES + 1))
    source = JwksSource("/jwks.json", JwksKeys(), fetch=fetch)
    assert not await source.load()
    assert "larger than" in (source.last_error or "")


async def test_file_fetch_refuses_oversized_files(tmp_path: Path):
    path = tmp_path / "big.json"
    path.write_bytes(b" " * (jwks_module.MAX_DOCUMENT_BYTES + 1))
    with pytest.raises(ValueError, match="larger than"):
        await jwks_module.fetch_location(str(path))


async def test_https_fetch(tmp_path: Path, monkeypatch):
    """The default fetch over real TLS (httpx under trio), trusting the CA in SSL_CERT_FILE."""
    import trustme

    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    document = jwks_doc(public_jwk(ec_key(), "k1"))
    too_big = b" " * (jwks_module.MAX_DOCUMENT_BYTES + 1)
    answers = {
        "/jwks.json": (200, document, True),
        "/missing": (404, b"{}", True),
        "/declared-big": (200, too_big, True),
        "/streamed-big": (200, too_big, False),  # no Content-Length: read until the limit
    }

    async def serve(stream: trio.SocketStream) -> None:
        tls = trio.SSLStream(stream, server_context, server_side=True)
        try:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = await tls.receive_some(65536)
                if not chunk:
                    return
                request += chunk
            status, body, declared = answers[request.split(b" ")[1].decode()]
            length = f"Content-Length: {len(body)}\r\n" if declared else ""
            await tls.send_all(f"HTTP/1.1 {status} X\r\n{length}Connection: close\r\n\r\n".encode() + body)
            await tls.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client hung up first: expected for the oversized answers

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        base = f"https://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        with trio.fail_after(10):
            assert await jwks_module.fetch_location(f"{base}/jwks.json") == document
            with pytest.raises(ValueError, match="HTTP 404"):
                await jwks_module.fetch_location(f"{base}/missing")
            for path in ("/declared-big", "/streamed-big"):
                with pytest.raises(ValueError, match="larger than"):
                    await jwks_module.fetch_location(f"{base}{path}")
            keys = JwksKeys()
            source = JwksSource(f"{base}/jwks.json", keys)
            assert await source.load() and keys.kids == ["k1"]
        monkeypatch.delenv("SSL_CERT_FILE")
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
        with trio.fail_after(10):
            assert not await source.load()  # an untrusted certificate
        assert "CERTIFICATE_VERIFY_FAILED" in (source.last_error or ""), source.last_error
        nursery.cancel_scope.cancel()


def test_jwks_location_must_be_https_or_a_path():
    for location in ("http://issuer.example/jwks.json", "ftp://x/y", ""):
        with pytest.raises(ValueError):
            JwksSource(location, JwksKeys())
    JwksSource("https://issuer.example/.well-known/jwks.json", JwksKeys())
    JwksSource("/etc/streamkeep/jwks.json", JwksKeys())


# ---- signed links ---------------------------------------------------------------------------

KEY_A = "a-link-secret-0123456789"
KEY_B = "b-link-secret-0123456789"


def test_link_sign_and_verify():
    keys = LinkKeys.parse(f"k1={KEY_A}")
    value = sign_link(keys, "a/b c", 1_900_000_000)
    version, kid, expires, mac = value.split(".")
    assert (version, kid, expires) == ("v1", "k1", "1900000000")
    expected = hmac.new(KEY_A.encode(), b"v1\nk1\n1900000000\na/b c", hashlib.sha256).digest()
    assert mac == b64(expected)
    principal = verify_link(keys, value, "a/b c", NOW)
    assert principal == Principal("link:k1", Grants.exact_read("a/b c"), 1_900_000_000.0, "link")
    assert principal.grants.allows("read", "a/b c")
    assert not principal.grants.allows("append", "a/b c") and not principal.grants.allows("read", "a/b")


def test_link_expiry_and_tampering():
    keys = LinkKeys.parse(f"k1={KEY_A}")
    value = sign_link(keys, "s", 1000)
    verify_link(keys, value, "s", 999.9)
    assert reason_of(verify_link, keys, value, "s", 1000) == "expired_link"
    version, kid, expires, mac = value.split(".")
    flipped = mac[:10] + ("A" if mac[10] != "A" else "B") + mac[11:]
    for bad in (
        f"{version}.{kid}.{expires}.{flipped}",
        f"{version}.{kid}.2000.{mac}",  # a later expiry
        f"{version}.{kid}.0{expires}.{mac}",  # a second spelling of the same expiry
        f"v2.{kid}.{expires}.{mac}",
        f"{version}.{kid}.{expires}",
        f"{version}.{kid}.{expires}.{mac}.x",
        f"{version}.{kid}.-1.{mac}",
        value + "A" * 200,
        "",
    ):
        assert reason_of(verify_link, keys, bad, "s", 0) == "bad_link", bad
    assert reason_of(verify_link, keys, value, "other", 0) == "bad_link"
    assert reason_of(verify_link, keys, value, "s", 2000) == "expired_link"


def test_link_name_is_literal():
    keys = LinkKeys.parse(f"k1={KEY_A}")
    value = sign_link(keys, "logs/*", 2000)
    assert verify_link(keys, value, "logs/*", 0).grants.allows("read", "logs/*")
    assert not verify_link(keys, value, "logs/*", 0).grants.allows("read", "logs/x")
    assert reason_of(verify_link, keys, value, "logs/x", 0) == "bad_link"


def test_link_key_rotation():
    old = LinkKeys.parse(f"old={KEY_A}")
    value = sign_link(old, "s", 2000)
    rotated = LinkKeys.parse(f"new={KEY_B}, old={KEY_A}")
    assert rotated.current == "new" and rotated.kids == ["new", "old"]
    assert verify_link(rotated, value, "s", 0).subject == "link:old"
    assert sign_link(rotated, "s", 2000).split(".")[1] == "new"
    retired = LinkKeys.parse(f"new={KEY_B}")
    assert reason_of(verify_link, retired, value, "s", 0) == "bad_link"
    # Same kid, another secret: the MAC does not verify.
    assert reason_of(verify_link, LinkKeys.parse(f"old={KEY_B}"), value, "s", 0) == "bad_link"
    with pytest.raises(ValueError):
        sign_link(old, "s", -1)
    with pytest.raises(ValueError):
        sign_link(old, "", 10)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "kid=SECRET"),
        ("k1", "kid=SECRET"),
        ("k1=short", "at least 16"),
        ("k1=has spaces in the secret", "at least 16"),
        (f"k.1={KEY_A}", "letters, digits"),
        (f"{'k' * 33}={KEY_A}", "letters, digits"),
        (f"k1={KEY_A},k1={KEY_B}", "twice"),
        (f"k1={KEY_A},", "kid=SECRET"),
    ],
)
def test_link_keys_parse_errors(text, message):
    with pytest.raises(ValueError, match=message):
        LinkKeys.parse(text)


def test_link_keys_parse_keeps_raw_secrets():
    keys = LinkKeys.parse(f" k1 = {KEY_A}=x , k_2-B={KEY_B}")
    assert keys.kids == ["k1", "k_2-B"]
    assert keys.secret("k1") == f"{KEY_A}=x".encode()
    assert KEY_A not in repr(keys)


def test_link_keys_file(tmp_path: Path):
    path = tmp_path / "keys" / "link-keys"
    keys = LinkKeys.load_or_create(path, now=NOW)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keys.current == "k20270115"
    kid, secret = path.read_text().split()
    assert kid == keys.current and len(secret) >= 40
    value = sign_link(keys, "s", 2000)
    again = LinkKeys.load_or_create(path, now=NOW + 86_400)
    assert again.kids == keys.kids and verify_link(again, value, "s", 0)
    rotated = LinkKeys.rotate(path, now=NOW)  # the same day: the kid still differs
    assert rotated.kids[1:] == ["k20270115"] and rotated.current.startswith("k20270115-")
    assert verify_link(LinkKeys.load_or_create(path), value, "s", 0).subject == "link:k20270115"
    for day in range(1, 7):
        rotated = LinkKeys.rotate(path, now=NOW + day * 86_400)
    assert len(rotated.kids) == 5 and rotated.current == "k20270121"
    assert reason_of(verify_link, LinkKeys.load_or_create(path), value, "s", 0) == "bad_link"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [line.split()[0] for line in path.read_text().splitlines()] == rotated.kids


def test_link_keys_file_edge_cases(tmp_path: Path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert len(LinkKeys.load_or_create(empty).kids) == 1
    commented = tmp_path / "commented"
    commented.write_text(f"# signing key first\n\nk1 {KEY_A}\nk0 {KEY_B}\n")
    assert LinkKeys.load_or_create(commented).kids == ["k1", "k0"]
    for text in (f"k1 {KEY_A} extra\n", "k1 short\n", "# only a comment\n"):
        broken = tmp_path / "broken"
        broken.write_text(text)
        with pytest.raises(ValueError, match=str(broken)):
            LinkKeys.load_or_create(broken)
    fresh = tmp_path / "fresh"
    assert len(LinkKeys.rotate(fresh).kids) == 1


def test_link_url():
    value = "v1.k1.10.x"
    assert (
        link_url("https://h.example/", "a/b c%d", value)
        == "https://h.example/v1/stream/a/b%20c%25d?signed=v1.k1.10.x"
    )
    assert link_url("http://127.0.0.1:4437", "é/?#", value) == (
        "http://127.0.0.1:4437/v1/stream/%C3%A9/%3F%23?signed=v1.k1.10.x"
    )


# ---- quotas ---------------------------------------------------------------------------------


def test_quotas_off():
    for rates in ((None, None), (0, 0)):
        quotas = Quotas(appends_per_second=rates[0], bytes_per_second=rates[1])
        assert not quotas.enabled
        assert all(quotas.charge("s", 10**9) is None for _ in range(100))
    with pytest.raises(ValueError):
        Quotas(appends_per_second=-1, bytes_per_second=None)
    with pytest.raises(ValueError):
        Quotas(appends_per_second=1, bytes_per_second=None, burst_seconds=0)


def test_append_rate():
    clock = Clock(0.0)
    quotas = Quotas(appends_per_second=1, bytes_per_second=None, burst_seconds=2, clock=clock)
    assert quotas.enabled
    assert quotas.charge("s", 10**9) is None
    assert quotas.charge("s", 0) is None
    assert quotas.charge("s", 0) == pytest.approx(1.0)
    assert quotas.charge("other", 0) is None  # per subject
    clock.now = 0.5
    assert quotas.charge("s", 0) == pytest.approx(0.5)
    clock.now = 1.0
    assert quotas.charge("s", 0) is None
    assert quotas.charge("s", 0) == pytest.approx(1.0)
    clock.now = 100.0
    assert [quotas.charge("s", 0) for _ in range(3)] == [None, None, pytest.approx(1.0)]  # a burst at most
    with pytest.raises(ValueError):
        quotas.charge("s", -1)
    assert quotas.stats()["refused"] == 4 and quotas.stats()["allowed"] == 6


def test_byte_rate_and_big_requests():
    clock = Clock(0.0)
    quotas = Quotas(appends_per_second=100, bytes_per_second=100, burst_seconds=2, clock=clock)
    assert quotas.charge("s", 150) is None
    assert quotas.charge("s", 100) == pytest.approx(0.5)  # 50 left, 100 needed
    assert quotas.charge("s", 50) is None  # the refusal charged nothing
    assert quotas.charge("s", 1) == pytest.approx(0.01)
    # Larger than the whole burst: waits for a full bucket, then passes into debt.
    assert quotas.charge("s", 1000) == pytest.approx(2.0)
    clock.now = 2.0
    assert quotas.charge("s", 1000) is None
    wait = quotas.charge("s", 1)
    assert wait == pytest.approx(8.01)
    clock.now = 2.0 + wait
    assert quotas.charge("s", 1) is None


def test_subjects_are_bounded_and_idle_ones_go_first():
    clock = Clock(0.0)
    quotas = Quotas(appends_per_second=None, bytes_per_second=10, max_subjects=10, clock=clock)
    assert quotas.charge("busy", 1000) is None  # deep in debt, and the least recently used
    for n in range(9):
        quotas.charge(f"idle{n}", 1)
    clock.now = 10.0  # the idle ones are full again; "busy" is still in debt
    assert quotas.charge("new", 1) is None
    assert quotas.stats()["subjects"] == 10 and quotas.stats()["evicted"] == 1
    assert quotas.charge("busy", 1) is not None  # still remembered, still limited
    for n in range(1000):
        quotas.charge(f"flood{n}", 1)
        assert len(quotas._buckets) <= 10
    assert quotas.stats()["evicted"] >= 990
