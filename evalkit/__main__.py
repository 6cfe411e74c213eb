from evalkit.run import main

main()
