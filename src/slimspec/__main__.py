from slimspec.cli import main

main()
