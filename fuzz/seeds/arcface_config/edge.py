config.a = ((((((1))))))
config.b = config.a // 0
