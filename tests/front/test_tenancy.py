from python_backends.front.tenancy import CacheSharing


def test_each_tenant_has_its_own_cache_by_default() -> None:
    sharing = CacheSharing()
    assert sharing.salt("a") != sharing.salt("b")
    assert sharing.salt("a") == sharing.salt("a")


def test_named_tenants_share() -> None:
    sharing = CacheSharing.parse(" a, b ,")
    assert sharing.salt("a") == sharing.salt("b") != sharing.salt("c")
    everyone = CacheSharing.parse("*")
    assert everyone.salt("x") == everyone.salt("y")


def test_a_request_salt_is_its_own_and_never_a_tenants() -> None:
    sharing = CacheSharing.parse("a")
    assert sharing.salt("a", "s1") == sharing.salt("b", "s1") != sharing.salt("a")
    assert sharing.salt("a", "tenant:b") != sharing.salt("b")
    assert sharing.salt("a", "shared") != sharing.salt("a")
