from ogrefs.cli.app import main

main()
