from capsvc.domain.money import amount


def test_amounts_in_the_currency_s_major_unit() -> None:
    assert amount(3750, "MAD") == "37.50 MAD"
    assert amount(5, "EUR") == "0.05 EUR"
    assert amount(-120, "EUR") == "-1.20 EUR"
    assert amount(1000, "XPF") == "1000 XPF"
    assert amount(1500, "KWD") == "1.500 KWD"
