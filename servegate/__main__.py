from servegate.cli import entry

entry()
