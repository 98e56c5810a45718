"""The relay process: LISTEN/NOTIFY wake-ups, polling, claiming and publishing."""
