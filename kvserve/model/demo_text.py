"""A small English text, written for kvserve, that the demo tokenizer is trained on.

Its only job is to give byte-level BPE enough distinct words to learn a
vocabulary of a couple of thousand tokens. Changing it changes the demo
tokenizer, so bump the demo version in demo.py when you edit it.
"""

DEMO_TEXT = """\
The morning was cold and bright. A small boat left the harbour before the sun had
climbed over the hills, and the fishermen talked quietly about the weather, the price
of bread, and the old lighthouse keeper who still counted every ship that passed.

In the library at the end of the street, a student opened a heavy book about memory.
Computers, the book explained, keep recent things close and old things far away. A
cache is a small, fast place that remembers what was used a moment ago, so that the
next question can be answered without walking all the way to the slow archive.

Language models read text one piece at a time. Each piece is called a token. When the
model writes an answer, it looks back at every token it has already seen, and it keeps
the keys and values of those tokens in a cache so that it does not compute them twice.
The cache is split into pages, or blocks, of equal size. Two requests that begin with
the same words can share the same blocks, which saves memory and time.

Questions and answers:
What is the capital of France? The capital of France is Paris.
What colour is the sky on a clear day? It is blue.
How many legs does a spider have? A spider has eight legs.
Why do leaves change colour in autumn? The green fades and the yellow and red remain.
Where do penguins live? Most penguins live in the southern half of the world.
Who wrote the letter? Nobody knows, but the handwriting was careful and patient.

A recipe for simple soup: wash four carrots, two potatoes, one onion and a handful of
green beans. Cut everything into small pieces. Warm a spoon of oil in a pot, soften the
onion, add the vegetables, cover them with water, and let them simmer for twenty
minutes. Season with salt, pepper and a little lemon juice. Serve it hot with bread.

The train to the mountains leaves at seven. Passengers carry backpacks, maps, cameras
and thermos flasks of tea. Outside the window, fields turn into forests, forests turn
into rocky slopes, and finally the snow appears, white and silent under a grey sky.

Numbers appear everywhere: one, two, three, four, five, six, seven, eight, nine, ten,
eleven, twelve, twenty, thirty, forty, fifty, hundred, thousand, million. Dates such as
1999, 2024 and 2025 and times such as 10:30 or 18:45 are written with digits.

def add(a, b):
    return a + b

for item in items:
    print(item)

A good engineer writes small functions, names them clearly, and tests the edges: the
empty list, the single element, the exact boundary, and the case that is one more than
the boundary. Bugs like to hide where two rules meet. When a test fails, read the
message slowly; it usually says exactly what is wrong.

The orchestra tuned their instruments while the audience found their seats. Violins,
cellos, flutes, trumpets, drums and a piano waited for the conductor, who raised her
hands, paused, and began. The music rose like a wave, fell into a whisper, and then
returned stronger than before.

Gardens need patience. Seeds sleep in the dark soil until rain and warmth wake them.
Roots reach down, stems reach up, and leaves open toward the light. A gardener waters,
weeds, waits, and sometimes talks to the plants, although they rarely answer.

History teaches that cities grow near rivers, that roads follow valleys, and that
markets appear wherever people meet. Merchants traded salt, silk, spices, wool, copper
and glass. Stories travelled with them, changing a little in every town.

Thank you for reading. Please remember to close the door, switch off the lights, and
return the borrowed umbrella before Friday. See you tomorrow, and have a pleasant
evening!
"""
