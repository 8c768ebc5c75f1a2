"""The configuration: the commented defaults (`defaults`), the typed, validated
settings every module below the entry points receives (`settings`), and the
generated reference `docs/configs.md` (`docs`)."""
