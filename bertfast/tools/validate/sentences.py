"""The fixed sentence set of the int8 accuracy report (`bertfast validate --model DIR --dtype int8`).

`sentences()` returns the same list on every call and machine: hand-written sentences of varied
length, register and topic (questions, fragments, lists, code-ish text, numbers, non-English words),
then sentences built from templates over a few topics so that each sentence has close neighbours
(paraphrases and near-topic sentences): nearest-neighbour agreement between int8 and fp32
embeddings is only a meaningful check when near ties exist. No randomness: the templates are
expanded in a fixed order.
"""

from __future__ import annotations

HAND_WRITTEN = (
    "Hi.",
    "Ok",
    "Thanks!",
    "Where is the nearest train station?",
    "How do I get to the train station from here?",
    "The quick brown fox jumps over the lazy dog.",
    "A fast brown fox leaped over a sleepy dog.",
    "The weather is lovely today.",
    "It is sunny and warm outside this afternoon.",
    "It has been raining all week and the river is about to flood.",
    "I forgot my umbrella and got soaked on the way home.",
    "Can you recommend a good Italian restaurant nearby?",
    "We had pasta with tomato sauce and a glass of red wine for dinner.",
    "My favourite dessert is chocolate cake with vanilla ice cream.",
    "The stock market fell sharply after the central bank raised interest rates.",
    "Investors worry that higher rates will slow economic growth.",
    "Inflation rose to 3.2% in October, the highest level in a year.",
    "The company reported quarterly revenue of $4.5 billion, up 12% from last year.",
    "Please reset my password; I cannot log in to my account.",
    "I am locked out of my account and need help signing in.",
    "The package was supposed to arrive on Monday but it is still missing.",
    "My order has not been delivered yet.",
    "Error: connection refused (errno 111) while connecting to 127.0.0.1:5432",
    "TypeError: unsupported operand type(s) for +: 'int' and 'str'",
    "def add(a, b): return a + b",
    "SELECT name, email FROM users WHERE created_at > '2024-01-01';",
    "The mitochondria is the powerhouse of the cell.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "DNA is copied before a cell divides.",
    "Black holes bend light so strongly that nothing escapes from inside the event horizon.",
    "The Moon orbits the Earth roughly once every 27 days.",
    "Water boils at 100 degrees Celsius at sea level.",
    "At high altitude water boils at a lower temperature.",
    "Shakespeare wrote Hamlet around the year 1600.",
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
    "Madrid is the capital and largest city of Spain.",
    "The Amazon rainforest produces a large share of the world's oxygen.",
    "Deforestation threatens thousands of species in tropical forests.",
    "She plays the violin in the city orchestra every Sunday.",
    "He has been learning to play the guitar for three years.",
    "The children built a sandcastle on the beach.",
    "Kids were playing with buckets and spades by the sea.",
    "Regular exercise lowers the risk of heart disease.",
    "Walking thirty minutes a day improves cardiovascular health.",
    "Drink plenty of water when you have a fever.",
    "The doctor prescribed antibiotics for the infection.",
    "Our flight was delayed by three hours because of a storm.",
    "The airline cancelled all flights due to bad weather.",
    "Bonjour, je voudrais un café, s'il vous plaît.",
    "Guten Morgen! Wie geht es dir?",
    "¿Dónde está la biblioteca?",
    "Machine learning models learn patterns from data.",
    "Neural networks are trained with gradient descent.",
    "Transformers use self-attention to relate every token to every other token.",
    "BERT is pretrained by predicting masked words in a sentence.",
    "Quantization stores weights in 8 bits to make inference faster.",
    "Int8 inference trades a little accuracy for a large speedup.",
    "The cat sat on the mat.",
    "A dog is sleeping on the rug.",
    "Two cats are fighting over a fish.",
    "This movie was absolutely fantastic, I loved every minute of it.",
    "The film was boring and far too long.",
    "Worst purchase ever: it broke after two days.",
    "Great value for money, works exactly as described.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10",
    "apples, oranges, bananas, grapes and pears",
    "To be, or not to be, that is the question.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "In the beginning God created the heaven and the earth.",
    "The meeting has been moved to Thursday at 3 pm.",
    "Can we reschedule our call to next week?",
    "Remember to bring your passport and boarding pass.",
    "The museum is closed on Mondays.",
    "Opening hours are from nine to five on weekdays.",
    "A long sentence that keeps going, listing trains, planes, bicycles, boats, buses, cars and "
    "scooters, all the ways people move around a crowded city on an ordinary weekday morning.",
    "When the committee finally published its report, after two years of hearings and thousands of "
    "pages of evidence, most of its recommendations had already been adopted by the ministry.",
)

# Topic templates: (subjects, predicates); every subject is combined with every predicate.
_TOPICS = (
    (("The new phone", "This laptop", "My tablet", "The smartwatch"),
     ("has a battery that lasts two days.", "charges very slowly.", "has a bright, sharp screen.",
      "keeps crashing after the latest update.", "is too expensive for what it offers.")),
    (("The football team", "Our basketball club", "The national rugby side", "The hockey team"),
     ("won the championship last night.", "lost three matches in a row.", "signed a new coach.",
      "is training hard before the final.", "celebrated with their fans in the city centre.")),
    (("The bakery on Main Street", "The corner cafe", "The new sushi bar", "That pizza place"),
     ("serves the best breakfast in town.", "is always crowded at lunchtime.",
      "raised its prices again.", "closed for renovation last month.", "has friendly staff.")),
    (("The government", "The city council", "Parliament", "The prime minister"),
     ("announced new taxes on fuel.", "approved a budget for public transport.",
      "promised to build more affordable housing.", "faces criticism over healthcare spending.",
      "delayed the vote until next month.")),
    (("The hiking trail", "The mountain path", "The coastal walk", "The forest track"),
     ("offers stunning views of the valley.", "is steep and rocky near the top.",
      "was closed after a landslide.", "is popular with families on weekends.",
      "takes about four hours to complete.")),
)

_QUESTIONS = (
    ("How do I", "What is the best way to", "Is it possible to", "Can someone explain how to"),
    ("cook rice without a rice cooker?", "learn a new language quickly?", "fix a flat bicycle tyre?",
     "save money on groceries?", "improve my sleep?", "train a neural network on a laptop?"),
)


def sentences() -> list[str]:
    """The fixed set: 78 hand-written sentences, 100 topic sentences, 24 questions (202 in all)."""
    out = list(HAND_WRITTEN)
    for subjects, predicates in _TOPICS:
        out += [f"{s} {p}" for s in subjects for p in predicates]
    starts, ends = _QUESTIONS
    out += [f"{s} {e}" for s in starts for e in ends]
    return out


__all__ = ["sentences", "HAND_WRITTEN"]
