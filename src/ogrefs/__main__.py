from ogrefs.cli.entry import main

main()
